"""A run's two datasets: the questions it trains on and those it is evaluated on, disjoint unless the recipe asks
otherwise, and then counted (``DataSets.report``) and warned about by the caller.

Where evaluation reads from:
- the arithmetic task: its held-out questions (``arithmetic_records``), by construction;
- ``data.eval_path``: that file, whatever else the recipe says;
- ``data.path`` without ``data.eval_path``: a held-out slice of the file (a fifth of its distinct questions, by a hash
  of the question), which training then skips: a file has no splits, and evaluating on its training rows would
  report training accuracy as held-out accuracy;
- otherwise ``data.eval_split`` of the named dataset (bundled copy or hub).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megatron_offgrpo.data._datasets import QARecord, load_local, load_records
from megatron_offgrpo.data._heldout import HELD_OUT_FRACTION, held_out_questions, question_key


@dataclasses.dataclass(frozen=True)
class DataSets:
    """Attributes: train (every training record, repeats included), eval (the evaluation records, in order),
    eval_source (where ``eval`` comes from, for the start line and ``run_info.json``)."""

    train: list[QARecord]
    eval: list[QARecord]
    eval_source: str

    def report(self, eval_prompts: int) -> dict[str, int | str]:
        """Sizes and overlap of the first ``eval_prompts`` evaluation records (those a run evaluates) against the
        training questions: ``eval_overlap`` counts evaluation records whose question is also trained on."""
        used = self.eval[:eval_prompts]
        trained = {question_key(r.question) for r in self.train}  # variants of one question count as one
        return {"train_size": len(self.train), "train_questions": len(trained), "eval_size": len(used),
                "eval_questions": len({question_key(r.question) for r in used}),
                "eval_overlap": sum(question_key(r.question) in trained for r in used),
                "eval_source": self.eval_source}


def split_held_out(records: list[QARecord], source: str) -> tuple[list[QARecord], list[QARecord]]:
    """``records`` less a held-out fifth of their distinct questions, and those held-out records (``_heldout``).

    Raises:
        ValueError: fewer than two distinct questions, naming ``source``.
    """
    try:
        held = held_out_questions(r.question for r in records)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}: give an evaluation file as data.eval_path") from None
    return ([r for r in records if question_key(r.question) not in held],
            [r for r in records if question_key(r.question) in held])


def load_datasets(name: str, split: str = "train", eval_split: str = "test", source: str = "auto",
                  path: str | None = None, eval_path: str | None = None, **kwargs) -> DataSets:
    """The training and evaluation records of a recipe's ``data`` section (see the module docstring).

    Args: as ``load_records`` (``kwargs``: the row keys, the arithmetic task's count, seed and largest operand), with
        ``eval_split`` the evaluation split and ``eval_path`` an evaluation file.

    Raises:
        ValueError, FileNotFoundError: from the readers, naming the file and line.
    """
    keys = {k: kwargs[k] for k in ("question_key", "answer_key") if k in kwargs}
    from_file = path is not None and source != "hub"  # a file replaces any named dataset, the arithmetic task too
    if name == "arithmetic" and not from_file and eval_path is None:
        train, evaluation = load_records(name, split, **kwargs), load_records(name, eval_split, **kwargs)
        side = "held-out" if eval_split != "train" else "training"
        return DataSets(train, evaluation, f"the arithmetic task's {side} questions")
    if from_file:
        records = load_local(path, **keys)
        if eval_path is None:
            train, evaluation = split_held_out(records, f"data.path={path}")
            share = f"{len(evaluation)} of its {len(records)} rows, {HELD_OUT_FRACTION:.0%} of its questions"
            return DataSets(train, evaluation, f"a held-out slice of data.path={Path(path).name} ({share}, by a hash "
                                               "of the question; training skips them; data.eval_path sets a file)")
    else:
        records = load_records(name, split, source, None, **kwargs)
    if eval_path is not None:
        return DataSets(records, load_local(eval_path, **keys), f"data.eval_path={eval_path}")
    return DataSets(records, load_records(name, eval_split, source, None, **kwargs), f"{name} split {eval_split!r}")
