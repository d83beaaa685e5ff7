"""Evaluation is held out by construction: the arithmetic task's questions are split once by a hash of the question
(training and evaluation disjoint, nothing lost, the same split for every seed and for the warm-up), a file is
evaluated on ``data.eval_path`` or on a held-out slice of itself that training skips, and any overlap the recipe asks
for is counted in ``run_info.json`` and warned about in one line."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys

import pytest

from megatron_offgrpo.config import load_config
from megatron_offgrpo.data import load_datasets
from megatron_offgrpo.data._datasets import load_records
from megatron_offgrpo.sampler import load_data
from tests.helpers import REPO

SFT, RL = str(REPO / "configs" / "tiny-cpu-sft.yaml"), str(REPO / "configs" / "tiny-cpu.yaml")


def _questions(records) -> set[str]:
    return {r.question for r in records}


@pytest.mark.parametrize("max_operand", [1, 5, 9, 20])
def test_arithmetic_training_and_held_out_questions_are_disjoint(max_operand):
    everything = {f"What is {a} + {b}?" for a in range(max_operand + 1) for b in range(max_operand + 1)}
    held = load_records("arithmetic", "test", count=3, seed=0, max_operand=max_operand)
    assert len(held) == len(_questions(held)) == max(1, round(len(everything) / 5))  # each held-out question once
    for seed in (0, 1234):
        train = load_records("arithmetic", "train", count=5000, seed=seed, max_operand=max_operand)
        assert not _questions(train) & _questions(held)  # disjoint
        assert _questions(train) | _questions(held) == everything  # nothing lost (5000 draws reach every question)
        # the held-out side depends on neither the seed nor the count: a warm-up and the RL run after it agree
        assert load_records("arithmetic", "test", count=7, seed=seed, max_operand=max_operand) == held
    for record in held:
        a, b = record.question.removeprefix("What is ").removesuffix("?").split(" + ")
        assert record.answer == f"#### {int(a) + int(b)}"


def test_the_demo_warm_up_and_rl_recipes_hold_out_the_same_questions():
    sft, rl = load_data(load_config(SFT)), load_data(load_config(RL))
    assert [r.question for r in sft.eval] == [r.question for r in rl.eval]
    assert not (_questions(sft.train) | _questions(rl.train)) & _questions(rl.eval)
    report = rl.report(load_config(RL).train.eval_prompts)
    assert report == {"train_size": 2000, "train_questions": 80, "eval_size": 20, "eval_questions": 20,
                      "eval_overlap": 0, "eval_source": "the arithmetic task's held-out questions"}


def test_an_eval_split_that_is_the_training_split_is_counted():
    data = load_datasets("arithmetic", "train", "train", count=200, seed=0, max_operand=9)
    report = data.report(50)
    assert report["eval_size"] == 50 and report["eval_overlap"] == 50
    assert report["eval_source"] == "the arithmetic task's training questions"


def _jsonl(path, questions):
    path.write_text("".join(json.dumps({"question": q, "answer": f"#### {i}"}) + "\n" for i, q in enumerate(questions)))
    return path


def test_a_file_without_an_eval_source_is_evaluated_on_a_held_out_slice_of_itself(tmp_path):
    questions = [f"Question {i}?" for i in range(50)] + ["Question 7?", "Question 7?"]  # a repeated question
    data = load_datasets("mine", path=str(_jsonl(tmp_path / "d.jsonl", questions)))
    assert len(_questions(data.eval)) == 10 and not _questions(data.train) & _questions(data.eval)
    assert len(data.train) + len(data.eval) == len(questions)  # every row on exactly one side
    assert "held-out slice of data.path=d.jsonl (10 of its 52 rows" in data.eval_source
    random.Random(0).shuffle(questions)  # the slice is chosen by the question, not the row order
    shuffled = load_datasets("mine", path=str(_jsonl(tmp_path / "s.jsonl", questions)))
    assert _questions(shuffled.eval) == _questions(data.eval)
    assert data.report(100)["eval_overlap"] == 0
    # the split/eval_split names do not reach a file: without data.eval_path the slice is all a file offers
    assert _questions(load_datasets("mine", "train", "test", path=str(tmp_path / "d.jsonl")).eval) == \
        _questions(data.eval)
    with pytest.raises(ValueError, match="data.path=.*one.jsonl: 1 distinct question.*give an evaluation file as "
                                         "data.eval_path"):
        load_datasets("mine", path=str(_jsonl(tmp_path / "one.jsonl", ["Same?"] * 3)))


def test_data_eval_path_is_honoured_for_files_and_named_datasets(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", [f"Train {i}?" for i in range(10)])
    held = _jsonl(tmp_path / "eval.jsonl", ["Eval 0?", "Eval 1?", "Train 3?"])  # one question shared
    data = load_datasets("mine", "train", "test", path=str(train), eval_path=str(held))
    assert len(data.train) == 10 and [r.question for r in data.eval] == ["Eval 0?", "Eval 1?", "Train 3?"]
    report = data.report(100)
    assert (report["eval_size"], report["eval_overlap"]) == (3, 1)
    assert report["eval_source"] == f"data.eval_path={held}"
    arithmetic = load_datasets("arithmetic", eval_path=str(held), count=10, seed=0, max_operand=3)
    assert [r.question for r in arithmetic.eval] == ["Eval 0?", "Eval 1?", "Train 3?"]


def test_the_gsm8k_recipe_evaluates_on_its_test_split():
    data = load_datasets("gsm8k", "train", "test")
    assert (len(data.train), len(data.eval), data.eval_source) == (7473, 1319, "gsm8k split 'test'")


@pytest.mark.slow
def test_run_info_counts_the_overlap_and_the_start_line_warns(tmp_path):
    """A real warm-up whose recipe evaluates on its training questions (data.eval_split=train): run_info.json holds
    both set sizes and the overlap, the console names the sizes and warns in one line."""
    out = tmp_path / "sft"
    proc = subprocess.run([sys.executable, "-m", "megatron_offgrpo.cli", "sft", "--config", SFT, "train.steps=1",
                           "data.count=40", "data.eval_split=train", "train.eval_prompts=16", f"train.out_dir={out}"],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / "run_info.json").read_text())["data"]
    assert data["train_size"] == 40 and data["eval_size"] == 16 and data["eval_overlap"] == 16
    assert data["eval_source"] == "the arithmetic task's training questions"
    assert f"data: 40 training prompts ({data['train_questions']} distinct questions); evaluation on 16 prompts" \
        in proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "ask a question the run trains on" in line]
    assert len(warnings) == 1 and "16 of the 16 evaluation prompts" in warnings[0]


def test_variants_of_a_question_in_case_unicode_form_or_spacing_fall_on_one_side(tmp_path):
    """A file repeating a question as "WHAT IS 12 + 30?", with full-width digits (NFKC) or with other spacing: the
    variants of a question are one question (``question_key``), so no variant of a training question is evaluated
    on."""
    from megatron_offgrpo.data._heldout import held_out_questions, question_key

    base = [f"What is {i} + {i + 1}?" for i in range(60)]
    variants = [q.upper() for q in base] + [q.replace(" + ", "\u00a0+  ") for q in base] + [
        q.translate(str.maketrans("0123456789", "０１２３４５６７８９")) for q in base]
    data = load_datasets("mine", path=str(_jsonl(tmp_path / "d.jsonl", base + variants)))
    train, held = {question_key(r.question) for r in data.train}, {question_key(r.question) for r in data.eval}
    assert len(train | held) == 60 and not train & held, "a variant landed on both sides"
    assert len(data.eval) == 4 * len(held) == 4 * 12  # each held-out question with its three variants
    # a question's variants rank by the lowest hash among them (a file without variants splits as it always did)
    assert held_out_questions(variants + base) == held
    by_hash = sorted(base, key=lambda q: hashlib.sha256(q.strip().encode()).digest())
    assert held_out_questions(base) == {question_key(q) for q in by_hash[:12]}
    assert question_key(" What  is\t２ + 3？ ") == "what is 2 + 3?"
    # an evaluation file asking a training question in other case is counted as overlap, not as unseen
    evaluation = _jsonl(tmp_path / "e.jsonl", [base[0].lower(), "Something else?"])
    report = load_datasets("mine", path=str(tmp_path / "d.jsonl"), eval_path=str(evaluation)).report(10)
    assert report["eval_overlap"] == 1 and report["eval_questions"] == 2
