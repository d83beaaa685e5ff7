"""Prompt datasets: question/answer records from the HF hub or local files, and a resumable prompt stream.

Online users get ``datasets.load_dataset``; offline machines read local JSONL/Parquet, and GSM8K ships with the
package (byte-identical to openai/grade-school-math, MIT). A synthetic arithmetic task with verifiable answers is
built in for demos and tests: a tiny model can learn it within minutes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path
from typing import Sequence

ASSETS = Path(__file__).resolve().parents[1] / "assets"
BUNDLED = {("gsm8k", "train"): ASSETS / "gsm8k" / "train.jsonl", ("gsm8k", "test"): ASSETS / "gsm8k" / "test.jsonl"}
HUB_IDS = {"gsm8k": ("openai/gsm8k", "main")}


@dataclasses.dataclass(frozen=True)
class QARecord:
    """One dataset row. Attributes: record_id (stable, e.g. "gsm8k/train/17"), question, answer (ground truth)."""

    record_id: str
    question: str
    answer: str


def _text(value: object, where: str, key: str) -> str:
    """A question/answer cell as text. Numbers (answers stored as ints) convert; a null, an empty or a non-text cell
    is refused here, naming the row: as a string ('None', '') it would fail at the first scoring, naming nothing."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return str(value)
    if isinstance(value, str) and value.strip():
        return value
    shown = repr(value) if len(repr(value)) <= 40 else f"a {type(value).__name__}"
    raise ValueError(f"{where}: {key!r} is {shown}; expected a non-empty string or a number")


def _from_rows(rows: Sequence[dict], prefix: str, question_key: str, answer_key: str, source: str) -> list[QARecord]:
    """Records named ``prefix/i``; errors name ``source`` (the file or hub id) and the row index ``i``."""
    records = []
    for i, row in enumerate(rows):
        where = f"{source} row {i}"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected an object with the question and answer, got {type(row).__name__}")
        if question_key not in row or answer_key not in row:
            raise ValueError(
                f"{where} has keys {sorted(row)}; expected {question_key!r} and {answer_key!r} "
                f"(set data.question_key / data.answer_key)"
            )
        records.append(QARecord(f"{prefix}/{i}", _text(row[question_key], where, question_key),
                                _text(row[answer_key], where, answer_key)))
    return records


def _in_package(path: Path) -> Path:
    """This package's copy of ``megatron_offgrpo/assets/...`` (as recipes write it) when the working directory has
    none, so that a recipe runs from any directory; any other path as given."""
    if path.exists() or path.parts[:2] != ("megatron_offgrpo", "assets"):
        return path
    bundled = ASSETS.joinpath(*path.parts[2:])
    return bundled if bundled.exists() else path


def load_local(path: str | Path, question_key: str = "question", answer_key: str = "answer") -> list[QARecord]:
    """Records from a local ``.jsonl`` / ``.json`` / ``.parquet`` file (``megatron_offgrpo/assets/...``: bundled)."""
    path = _in_package(Path(path))
    if not path.is_file():
        raise FileNotFoundError(f"{path}: dataset file not found")
    if path.suffix == ".parquet":
        import datasets

        rows = datasets.load_dataset("parquet", data_files=str(path), split="train")
    elif path.suffix == ".json":
        rows = json.loads(path.read_text())
    else:
        rows = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{n}: not valid JSON ({exc})") from None
    return _from_rows(rows, path.stem, question_key, answer_key, str(path))


def load_hub(name: str, split: str, question_key: str = "question", answer_key: str = "answer") -> list[QARecord]:
    """Records from the Hugging Face hub via ``datasets.load_dataset`` (needs network or a warm HF cache)."""
    import datasets

    repo, config = HUB_IDS.get(name, (name, None))
    rows = datasets.load_dataset(repo, config, split=split)
    return _from_rows(rows, f"{name}/{split}", question_key, answer_key, f"hub dataset {repo} split {split}")


def arithmetic_records(count: int, seed: int, max_operand: int = 20) -> list[QARecord]:
    """A synthetic task with verifiable answers: "What is a + b?" with the sum as the answer (``#### N``)."""
    rng = random.Random(seed)
    records = []
    for i in range(count):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        records.append(QARecord(f"arith/{seed}/{i}", f"What is {a} + {b}?", f"#### {a + b}"))
    return records


def load_records(
    name: str, split: str = "train", source: str = "auto", path: str | None = None, **kwargs
) -> list[QARecord]:
    """Load a prompt dataset.

    Args:
        name: "gsm8k", "arithmetic", or a hub dataset id. split: "train" / "test".
        source: "local" (bundled or ``path``), "hub" (``datasets.load_dataset``), "auto" (``path`` if given, then
            the bundled copy, then the hub).
        path: a local file overriding the bundled copy.
        kwargs: ``question_key`` / ``answer_key`` for local and hub rows; ``count``/``seed``/``max_operand`` for
            "arithmetic".
    """
    if source not in ("auto", "local", "hub"):
        raise ValueError(f"data.source={source!r}: expected 'auto', 'local' or 'hub'")
    if name == "arithmetic":
        seed = kwargs.get("seed", 0) + (0 if split == "train" else 10_000)
        return arithmetic_records(kwargs.get("count", 2000), seed, kwargs.get("max_operand", 20))
    keys = {k: kwargs[k] for k in ("question_key", "answer_key") if k in kwargs}
    if path is not None and source != "hub":
        return load_local(path, **keys)
    if source != "hub" and (name, split) in BUNDLED:
        records = load_local(BUNDLED[(name, split)], **keys)
        return [dataclasses.replace(r, record_id=f"{name}/{split}/{r.record_id.rsplit('/', 1)[1]}") for r in records]
    if source == "local":
        raise ValueError(f"no local copy of dataset {name!r} split {split!r}: pass data.path=FILE or data.source=hub")
    return load_hub(name, split, **keys)
