"""Bad dataset rows are refused at load, naming the file (or hub id), the row and the key; bundled data files
resolve from any working directory."""

from __future__ import annotations

import json
import re

import pytest

from megatron_offgrpo.data._datasets import load_hub, load_local, load_records


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize(("bad", "key", "shown"), [
    ({"question": "1+1?", "answer": None}, "answer", "None"),  # was the string 'None', failing at the first scoring
    ({"question": "", "answer": "#### 2"}, "question", "''"),
    ({"question": "1+1?", "answer": "  "}, "answer", "'  '"),
    ({"question": ["1+1?"], "answer": "#### 2"}, "question", "\\['1\\+1\\?'\\]"),
    ({"question": "1+1?", "answer": True}, "answer", "True"),  # a bool is not a number here
])
def test_null_empty_or_non_text_cell_names_file_row_and_key(tmp_path, bad, key, shown):
    path = _jsonl(tmp_path / "d.jsonl", [{"question": "2+2?", "answer": "#### 4"}, bad])
    expected = f"^{re.escape(str(path))}:2: '{key}' is {shown}; expected a non-empty string or a number$"  # file:line
    with pytest.raises(ValueError, match=expected):
        load_local(path)


def test_numbers_are_converted_and_non_objects_refused(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"question": "1+1?", "answer": 2}, {"question": 7, "answer": 1.5}]))
    assert [(r.question, r.answer) for r in load_local(path)] == [("1+1?", "2"), ("7", "1.5")]
    path.write_text(json.dumps([{"question": "1+1?", "answer": 2}, 42]))
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))} row 1: expected an object .*, got int$"):
        load_local(path)


def test_hub_rows_name_the_hub_id(monkeypatch):
    import datasets

    # stands in for the network only: the rows the hub would return
    monkeypatch.setattr(datasets, "load_dataset", lambda repo, config, split: [{"question": "q", "answer": None}])
    with pytest.raises(ValueError, match="^hub dataset openai/gsm8k split train row 0: 'answer' is None"):
        load_hub("gsm8k", "train")


def test_bundled_data_path_resolves_from_another_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # recipes write data.path relative to the repository root
    records = load_records("gsm8k", "test", path="megatron_offgrpo/assets/gsm8k/test.jsonl")
    assert len(records) == 1319 and records[0].answer.rstrip().split()[-1] == "18"
    with pytest.raises(FileNotFoundError, match="^megatron_offgrpo/assets/gsm8k/nope.jsonl: dataset file not found$"):
        load_local("megatron_offgrpo/assets/gsm8k/nope.jsonl")


def test_a_row_may_cap_its_own_completions(tmp_path):
    """``max_new_tokens`` in a row: the prompt's own cap, under the run's (``Prompt.sampling``); a bad one is one line
    naming file:line."""
    from megatron_offgrpo.data import Prompt, SamplingParams

    path = _jsonl(tmp_path / "d.jsonl", [{"question": "a", "answer": "1", "max_new_tokens": 5},
                                        {"question": "b", "answer": "2"}])
    assert [r.max_new_tokens for r in load_local(path)] == [5, None]
    run = SamplingParams(max_tokens=16, temperature=1.0, seed=3)
    assert Prompt("p", (1,), max_new_tokens=5).sampling(run) == SamplingParams(16 - 11, 1.0, seed=3)
    assert Prompt("p", (1,), max_new_tokens=64).sampling(run) is run and Prompt("p", (1,)).sampling(run) is run
    for bad in (0, -3, "5", 2.5, True):
        path = _jsonl(tmp_path / "bad.jsonl", [{"question": "a", "answer": "1", "max_new_tokens": bad}])
        with pytest.raises(ValueError, match=f"^{re.escape(str(path))}:1: max_new_tokens={re.escape(repr(bad))}: "
                                             "give a positive integer"):
            load_local(path)
