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

from megatron_offgrpo.data._heldout import held_out_questions, ordered_by_hash, question_key

ASSETS = Path(__file__).resolve().parents[1] / "assets"
BUNDLED = {("gsm8k", "train"): ASSETS / "gsm8k" / "train.jsonl", ("gsm8k", "test"): ASSETS / "gsm8k" / "test.jsonl"}
HUB_IDS = {"gsm8k": ("openai/gsm8k", "main")}


MAX_JSON_INT_DIGITS = 4300
"""Python's own limit on int(str) (sys.get_int_max_str_digits): json.loads raises a bare ValueError past it, so a
longer integer cell is kept as its digit string and the answer check (data._rewards.answer_error) names the row."""


@dataclasses.dataclass(frozen=True)
class QARecord:
    """One dataset row. Attributes: record_id (stable, e.g. "gsm8k/train/17"), question, answer (ground truth), where
    (the row's place for error lines: "FILE:LINE" for JSONL, "FILE row i" otherwise; not part of equality)."""

    record_id: str
    question: str
    answer: str
    where: str = dataclasses.field(default="", compare=False)
    max_new_tokens: int | None = None  # the row's own cap on its completions (an optional ``max_new_tokens`` key)


def _text(value: object, where: str, key: str) -> str:
    """A question/answer cell as text. Numbers (answers stored as ints) convert; a null, an empty, a non-finite or a
    non-text cell is refused here, naming the row: as a string ('None', '', 'inf') it would fail at the first scoring,
    naming nothing."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if math.isfinite(value):
            return str(value)
        raise ValueError(f"{where}: {key!r} is {value!r}, not a finite number")
    if isinstance(value, str) and value.strip():
        return value
    shown = repr(value) if len(repr(value)) <= 40 else f"a {type(value).__name__}"
    raise ValueError(f"{where}: {key!r} is {shown}; expected a non-empty string or a number")


def _from_rows(rows: Sequence[object], wheres: Sequence[str], prefix: str, question_key: str,
               answer_key: str) -> list[QARecord]:
    """Records named ``prefix/i``; errors name the row by ``wheres[i]`` (its file and line, or hub id and index)."""
    records = []
    for i, (row, where) in enumerate(zip(rows, wheres)):
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected an object with the question and answer, got {type(row).__name__}")
        missing = [key for key in (question_key, answer_key) if key not in row]
        if missing:
            setting = "data.question_key" if missing[0] == question_key else "data.answer_key"
            raise ValueError(f"{where}: no {missing[0]!r} key (the row has {sorted(row)[:8]}): fix the row or set "
                             f"{setting}")
        records.append(QARecord(f"{prefix}/{i}", _text(row[question_key], where, question_key),
                                _text(row[answer_key], where, answer_key), where, _cap(row, where)))
    return records


def _cap(row: dict, where: str) -> int | None:
    """The row's optional ``max_new_tokens``: a positive integer, or absent."""
    value = row.get("max_new_tokens")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: max_new_tokens={value!r}: give a positive integer (the row's own cap on its "
                         "completions) or leave the key out")
    return value


def _in_package(path: Path) -> Path:
    """This package's copy of ``megatron_offgrpo/assets/...`` (as recipes write it) when the working directory has
    none, so that a recipe runs from any directory; any other path as given."""
    if path.exists() or path.parts[:2] != ("megatron_offgrpo", "assets"):
        return path
    bundled = ASSETS.joinpath(*path.parts[2:])
    return bundled if bundled.exists() else path


def _json_int(digits: str) -> int | str:
    return int(digits) if len(digits.lstrip("-")) <= MAX_JSON_INT_DIGITS else digits


def _decode(raw: bytes, path: Path, line: int) -> str:
    """One line (or a whole ``.json``) as text; binary bytes name the file, the line and the byte's column."""
    try:
        return raw.decode("utf-8-sig" if line <= 1 else "utf-8")  # a byte-order mark (Windows editors) is no data
    except UnicodeDecodeError as exc:
        if line == 0:  # a whole .json: the line of the bad byte
            line, column = raw.count(b"\n", 0, exc.start) + 1, exc.start - raw.rfind(b"\n", 0, exc.start)
        else:
            column = exc.start + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {column}): a binary "
                         "file? datasets are JSONL, JSON or Parquet") from None


BINARY_MAGIC = {b"PAR1": "Parquet", b"\x1f\x8b": "gzip-compressed", b"PK\x03\x04": "a zip archive",
                b"BZh": "bzip2-compressed", b"\xfd7zXZ\x00": "xz-compressed", b"(\xb5/\xfd": "zstd-compressed"}
"""How a binary file given as JSON/JSONL starts: its bytes may decode as text by chance (Parquet's do, up to its
first non-ASCII byte), and the first line would be called "cut short"."""


def _binary_error(data: bytes, path: Path) -> str | None:
    """Why the bytes of a file given as JSON or JSONL are not text at all, naming the file, or None: a known binary
    format's leading bytes, or a NUL byte among the first 8 KiB (text never holds one)."""
    what = next((name for magic, name in BINARY_MAGIC.items() if data.startswith(magic)), None)
    if what is None and b"\x00" not in data[:8192]:
        return None
    fix = ("name it .parquet to read it as Parquet" if what == "Parquet" else "decompress it first" if what and
           what.endswith("compressed") else "datasets are JSONL, JSON or Parquet")
    return f"{path}: a binary file ({what or 'NUL bytes'}), not {path.suffix or 'JSONL'} text: {fix}"


def _jsonl_rows(path: Path) -> tuple[list[object], list[str]]:
    rows, wheres = [], []
    data = path.read_bytes()
    if (binary := _binary_error(data, path)) is not None:
        raise ValueError(binary)
    for n, raw in enumerate(data.splitlines(), 1):
        line = _decode(raw, path, n)
        if line.strip():
            try:
                rows.append(json.loads(line, parse_int=_json_int))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not valid JSON ({exc}): a line cut short? fix or remove it") from None
            wheres.append(f"{path}:{n}")
    return rows, wheres


def _json_rows(path: Path) -> tuple[list[object], list[str]]:
    data = path.read_bytes()
    if (binary := _binary_error(data, path)) is not None:
        raise ValueError(binary)
    try:
        rows = json.loads(_decode(data, path, 0), parse_int=_json_int)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{exc.lineno}: not valid JSON ({exc}): a file cut short?") from None
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a JSON list of rows, got {type(rows).__name__} (or use JSONL)")
    return rows, [f"{path} row {i}" for i in range(len(rows))]


def _parquet_rows(path: Path) -> tuple[list[object], list[str]]:
    import datasets

    try:
        rows = list(datasets.load_dataset("parquet", data_files=str(path), split="train"))
    except Exception as exc:  # noqa: BLE001 - pyarrow's errors have no common base; each is an unreadable file here
        raise ValueError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc})".splitlines()[0]) from None
    return rows, [f"{path} row {i}" for i in range(len(rows))]


def load_local(path: str | Path, question_key: str = "question", answer_key: str = "answer") -> list[QARecord]:
    """Records from a local ``.jsonl`` / ``.json`` / ``.parquet`` file (``megatron_offgrpo/assets/...``: bundled).

    Raises:
        FileNotFoundError: no such file. ValueError: a directory, an empty file, a line that is not JSON or not UTF-8,
            a row without the question or answer key or with an empty or non-finite cell (each naming file and line).
    """
    path = _in_package(Path(path))
    if path.is_dir():
        raise ValueError(f"{path}: a directory, not a dataset file: give a .jsonl, .json or .parquet file")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: dataset file not found")
    reader = {".parquet": _parquet_rows, ".json": _json_rows}.get(path.suffix, _jsonl_rows)
    rows, wheres = reader(path)
    if not rows:
        raise ValueError(f"{path}: an empty dataset (no rows): give a file with at least one question")
    return _from_rows(rows, wheres, path.stem, question_key, answer_key)


def load_hub(name: str, split: str, question_key: str = "question", answer_key: str = "answer") -> list[QARecord]:
    """Records from the Hugging Face hub via ``datasets.load_dataset`` (needs network or a warm HF cache)."""
    import datasets

    repo, config = HUB_IDS.get(name, (name, None))
    rows = datasets.load_dataset(repo, config, split=split)
    wheres = [f"hub dataset {repo} split {split} row {i}" for i in range(len(rows))]
    return _from_rows(rows, wheres, f"{name}/{split}", question_key, answer_key)


def arithmetic_questions(max_operand: int) -> list[tuple[int, int]]:
    """Every (a, b) of the synthetic task, 0 <= a, b <= ``max_operand``: (max_operand + 1)^2 distinct questions."""
    return [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]


def _question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def arithmetic_records(count: int, seed: int, max_operand: int = 20, held_out: bool = False) -> list[QARecord]:
    """A synthetic task with verifiable answers: "What is a + b?" with the sum as the answer (``#### N``).

    The questions are split once by a hash of their text (``_heldout``: a fifth held out, at least one): the training
    side is ``count`` draws (seeded) from the other questions; the held-out side (``held_out``) is each held-out
    question once, in hash order, whatever ``count`` and ``seed``. The two never share a question.

    Raises:
        ValueError: ``max_operand`` < 1 (one question cannot be split).
    """
    pairs = arithmetic_questions(max_operand)
    try:
        held = held_out_questions(_question(a, b) for a, b in pairs)
    except ValueError as exc:
        raise ValueError(f"data.max_operand={max_operand}: the arithmetic task has {exc}; use max_operand >= 1"
                         ) from None
    if held_out:
        sums = {_question(a, b): a + b for a, b in pairs if question_key(_question(a, b)) in held}
        return [QARecord(f"arith/held-out/{i}", q, f"#### {sums[q]}", f"arithmetic held-out question {i}")
                for i, q in enumerate(ordered_by_hash(sums))]
    train = [(a, b) for a, b in pairs if question_key(_question(a, b)) not in held]
    rng = random.Random(seed)
    records = []
    for i in range(count):
        a, b = rng.choice(train)
        records.append(QARecord(f"arith/{seed}/{i}", _question(a, b), f"#### {a + b}", f"arithmetic record {i}"))
    return records


def load_records(
    name: str, split: str = "train", source: str = "auto", path: str | None = None, **kwargs
) -> list[QARecord]:
    """Load a prompt dataset.

    Args:
        name: "gsm8k", "arithmetic", or a hub dataset id. split: "train" / "test" (arithmetic: "train" is the
            training questions, any other split the held-out ones).
        source: "local" (bundled or ``path``), "hub" (``datasets.load_dataset``), "auto" (``path`` if given, then
            the bundled copy, then the hub).
        path: a local file overriding the bundled copy: all its rows, whatever ``split`` (``load_datasets`` holds some
            out for evaluation).
        kwargs: ``question_key`` / ``answer_key`` for local and hub rows; ``count``/``seed``/``max_operand`` for
            "arithmetic".
    """
    if source not in ("auto", "local", "hub"):
        raise ValueError(f"data.source={source!r}: expected 'auto', 'local' or 'hub'")
    if name == "arithmetic" and path is None:
        return arithmetic_records(kwargs.get("count", 2000), kwargs.get("seed", 0), kwargs.get("max_operand", 20),
                                  held_out=split != "train")
    keys = {k: kwargs[k] for k in ("question_key", "answer_key") if k in kwargs}
    if path is not None and source != "hub":
        return load_local(path, **keys)
    if source != "hub" and (name, split) in BUNDLED:
        records = load_local(BUNDLED[(name, split)], **keys)
        return [dataclasses.replace(r, record_id=f"{name}/{split}/{r.record_id.rsplit('/', 1)[1]}") for r in records]
    if source == "local":
        raise ValueError(f"no local copy of dataset {name!r} split {split!r}: pass data.path=FILE or data.source=hub")
    return load_hub(name, split, **keys)
