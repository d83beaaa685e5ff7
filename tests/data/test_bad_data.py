"""Bad dataset files are refused before anything starts: `offgrpo train`, `sft` and `eval` print one line naming the
file and line (and the key, or the token count) and exit 2, with nothing written. Each case is a real file read by the
real loader; the prompt-length case counts with the real Qwen2.5 tokenizer."""

from __future__ import annotations

import json
import re

import pytest
import transformers

from megatron_offgrpo.cli import main
from tests.helpers import REPO, TOKENIZER_DIR

RECIPE = str(REPO / "configs" / "tiny-cpu-sft.yaml")  # plain prompts, no instruction, max_prompt_tokens 64
GOOD = json.dumps({"question": "What is 1 + 1?", "answer": "#### 2"})
LONG = "What is " + " + ".join(["1"] * 40) + "?"  # 40 operands: over 64 tokens


def _row(answer: object) -> str:
    return json.dumps({"question": "What is 2 + 2?", "answer": answer})


# (file name, its bytes, the one error line after "error: " with {path} for the file)
CASES = {
    "cut_in_half": ("d.jsonl", f"{GOOD}\n{GOOD[:25]}\n", "{path}:2: not valid JSON (Unterminated string starting at: "
                    "line 1 column 14 (char 13)): a line cut short? fix or remove it"),
    "no_answer_key": ("d.jsonl", f"{GOOD}\n\n" + json.dumps({"question": "q?", "solution": "#### 2"}) + "\n",
                      "{path}:3: no 'answer' key (the row has ['question', 'solution']): fix the row or set "
                      "data.answer_key"),
    "empty_file": ("d.jsonl", "", "{path}: an empty dataset (no rows): give a file with at least one question"),
    "blank_lines": ("d.jsonl", "\n  \n", "{path}: an empty dataset (no rows): give a file with at least one question"),
    "5001_digits_int": ("d.jsonl", f"{GOOD}\n{{\"question\": \"big?\", \"answer\": {'9' * 5001}}}\n",
                        "{path}:2: the answer has 5001 digits (at most 100): fix or remove the row "
                        "(data.reward=math_exact compares numbers)"),
    "5001_digits_text": ("d.jsonl", f"{GOOD}\n{_row('#### ' + '9' * 5001)}\n",
                         "{path}:2: the answer has 5001 digits (at most 100): fix or remove the row "
                         "(data.reward=math_exact compares numbers)"),
    "inf_text": ("d.jsonl", f"{GOOD}\n{_row('inf')}\n", "{path}:2: the answer 'inf' is not a finite number: fix or "
                 "remove the row (data.reward=math_exact compares numbers)"),
    "nan_text": ("d.jsonl", f"{GOOD}\n{_row('#### nan')}\n", "{path}:2: the answer 'nan' is not a finite number: fix "
                 "or remove the row (data.reward=math_exact compares numbers)"),
    "1e999_text": ("d.jsonl", f"{GOOD}\n{_row('#### 1e999')}\n", "{path}:2: the answer '1e999' is not a finite "
                   "number: fix or remove the row (data.reward=math_exact compares numbers)"),
    "1e999_number": ("d.jsonl", f'{GOOD}\n{{"question": "q?", "answer": 1e999}}\n',
                     "{path}:2: 'answer' is inf, not a finite number"),
    "NaN_number": ("d.jsonl", f'{GOOD}\n{{"question": "q?", "answer": NaN}}\n',
                   "{path}:2: 'answer' is nan, not a finite number"),
    "binary_bytes": ("d.jsonl", GOOD.encode() + b"\n\x89PNG\r\n\x1a\n",
                     "{path}:2: not UTF-8 text (byte 0x89 at column 1): a binary file? datasets are JSONL, JSON or "
                     "Parquet"),
    "parquet_as_jsonl": ("d.jsonl", b"PAR1\x15\x04\x15\x10" + b'{"question": "q?"}\n' * 3,  # ASCII up to here
                         "{path}: a binary file (Parquet), not .jsonl text: name it .parquet to read it as Parquet"),
    "gzip_as_json": ("d.json", b"\x1f\x8b\x08\x00" + GOOD.encode(), "{path}: a binary file (gzip-compressed), not "
                     ".json text: decompress it first"),
    "nul_bytes": ("d.jsonl", GOOD.encode() + b"\n\x00\x00\x00\x01", "{path}: a binary file (NUL bytes), not .jsonl "
                  "text: datasets are JSONL, JSON or Parquet"),
    "json_cut_in_half": ("d.json", f"[{GOOD},\n{GOOD[:30]}", "{path}:2: not valid JSON (Expecting property name "
                         "enclosed in double quotes: line 2 column 31 (char 83)): a file cut short?"),
    "json_binary": ("d.json", f"[{GOOD},\n".encode() + b"\xff\xfe]", "{path}:2: not UTF-8 text (byte 0xff at column "
                    "1): a binary file? datasets are JSONL, JSON or Parquet"),
}


def _run(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    return exit_.value.code, capsys.readouterr().err


def _write(path, content):
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return path


def _assert_one_line(code, err, expected, out):
    assert code == 2, err
    assert err.splitlines() == [f"error: {expected}"], err  # one line, no traceback
    assert not out.exists()  # nothing started: no run directory


@pytest.mark.parametrize("command", ["train", "sft", "eval"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_data_file_is_one_line_naming_file_and_line(command, case, tmp_path, capsys):
    name, content, expected = CASES[case]
    path = _write(tmp_path / name, content)
    out = tmp_path / "run"
    code, err = _run([command, "--config", RECIPE, f"data.path={path}", f"train.out_dir={out}"], capsys)
    _assert_one_line(code, err, expected.format(path=path), out)


@pytest.mark.parametrize("command", ["train", "eval"])
def test_bad_eval_file_is_named_too(command, tmp_path, capsys):
    """data.eval_path is read before the run as the training file is: its bad line is named."""
    path = _write(tmp_path / "eval.jsonl", f"{GOOD}\n{_row('#### inf')}\n")
    out = tmp_path / "run"
    code, err = _run([command, "--config", RECIPE, f"data.eval_path={path}", f"train.out_dir={out}"], capsys)
    _assert_one_line(code, err, f"{path}:2: the answer 'inf' is not a finite number: fix or remove the row "
                                "(data.reward=math_exact compares numbers)", out)


@pytest.mark.parametrize("command", ["train", "sft", "eval"])
def test_a_directory_or_a_missing_file(command, tmp_path, capsys):
    out = tmp_path / "run"
    code, err = _run([command, "--config", RECIPE, f"data.path={tmp_path}", f"train.out_dir={out}"], capsys)
    _assert_one_line(code, err, f"{tmp_path}: a directory, not a dataset file: give a .jsonl, .json or .parquet file",
                     out)
    code, err = _run([command, "--config", RECIPE, f"data.path={tmp_path / 'nope.jsonl'}", f"train.out_dir={out}"],
                     capsys)
    _assert_one_line(code, err, f"{tmp_path / 'nope.jsonl'}: dataset file not found", out)


@pytest.mark.parametrize("command", ["train", "sft", "eval"])
def test_a_prompt_over_max_prompt_tokens_names_its_line_and_token_count(command, tmp_path, capsys):
    tokens = len(transformers.AutoTokenizer.from_pretrained(TOKENIZER_DIR).encode(LONG, add_special_tokens=False))
    assert tokens > 64  # the recipe's data.max_prompt_tokens
    rows = [GOOD] * 3 + [json.dumps({"question": LONG, "answer": "#### 40"})]
    path = _write(tmp_path / "d.jsonl", "\n".join(rows) + "\n")
    out = tmp_path / "run"
    code, err = _run([command, "--config", RECIPE, f"data.path={path}", f"train.out_dir={out}"], capsys)
    _assert_one_line(code, err, f"{path}:4: the prompt has {tokens} tokens > data.max_prompt_tokens=64: shorten or "
                                "remove the row, or raise data.max_prompt_tokens", out)


def test_a_custom_reward_takes_non_numeric_answers(tmp_path):
    """Only the math rewards need a number: a custom reward's ground truth is its own business."""
    from megatron_offgrpo.config import load_config
    from megatron_offgrpo.preflight._checks import data_errors

    path = _write(tmp_path / "d.jsonl", "\n".join(json.dumps({"question": f"Name {i}?", "answer": "blue"})
                                                   for i in range(5)) + "\n")
    custom = load_config(RECIPE, [f"data.path={path}", "data.reward=tests.train.rewards:even_length"])
    assert data_errors(custom) == []
    math = load_config(RECIPE, [f"data.path={path}"])
    assert re.fullmatch(re.escape(f"{path}:") + r"\d: the answer 'blue' holds no number: .*", data_errors(math)[0])
