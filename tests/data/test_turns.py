"""Observations are appended token by token: their ids, concatenated after the sampled turns, are what the chat
template itself gives for the whole conversation (Qwen2.5's and Qwen3's templates, tool calls and tool responses)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from megatron_offgrpo.data import ASSETS
from megatron_offgrpo.data._turns import observation_ids, turn_wrapping
from tests.helpers import qwen3_tokenizer_dir

TOOLS = [{"type": "function", "function": {"name": "python", "description": "Run Python code.",
                                           "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                                                          "required": ["code"]}}}]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir(tmp_path_factory.mktemp("qwen3")))


@pytest.fixture(scope="module", params=["qwen2.5", "qwen3"])
def tokenizer(request, qwen3):
    return AutoTokenizer.from_pretrained(ASSETS / "qwen2-tokenizer") if request.param == "qwen2.5" else qwen3


def _is_qwen3(tokenizer) -> bool:
    return tokenizer.convert_tokens_to_ids("<think>") == 151667


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _prompt(tokenizer, messages: list[dict], tools=None) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_tool_turns_concatenate_to_the_templates_conversation(tokenizer):
    """Prompt (with tools) + turn 1 (a tool call as the template writes it, then EOS) + tool response + turn 2 + tool
    response + turn 3 (the answer): the separately tokenised pieces, concatenated, are the template's own
    tokenisation of the whole conversation (Qwen3's turns think first, as that model does)."""
    think = ["<think>\nI run it.\n</think>\n\n", "<think>\nOnce more.\n</think>\n\n",
             "<think>\nDone.\n</think>\n\n"] if _is_qwen3(tokenizer) else ["", "", ""]
    codes, results = ["print(17 * 23)", "print(391 + 0)"], ["391", "391\n"]
    system, user = {"role": "system", "content": "Solve with the tool."}, {"role": "user", "content": "17 * 23?"}
    conversation = [system, user]
    for code, result, reasoning in zip(codes, results, think):
        conversation += [{"role": "assistant", "content": reasoning, "tool_calls": [
            {"type": "function", "function": {"name": "python", "arguments": {"code": code}}}]},
            {"role": "tool", "content": result}]
    conversation.append({"role": "assistant", "content": think[2] + "The answer is #### 391"})
    whole = _ids(tokenizer, tokenizer.apply_chat_template(conversation, tools=TOOLS, tokenize=False))

    wrapping, eos = turn_wrapping(tokenizer, "tool"), tokenizer.eos_token_id
    pieces = _prompt(tokenizer, [system, user], TOOLS)
    for code, result, reasoning in zip(codes, results, think):
        call = f'<tool_call>\n{{"name": "python", "arguments": {json.dumps({"code": code})}}}\n</tool_call>'
        pieces += _ids(tokenizer, reasoning + call) + [eos] + observation_ids(tokenizer, wrapping, result)
    pieces += _ids(tokenizer, think[2] + "The answer is #### 391") + [eos]
    assert pieces == whole[:-1] and whole[-1:] == _ids(tokenizer, "\n")  # the template's newline after the last EOS


def test_qwen3_re_rendering_loses_sampled_tokens(qwen3):
    """Why the runner never re-renders: after a user message, Qwen3's template drops the thinking of earlier turns,
    so the conversation's text no longer holds the tokens the model sampled; the appended sequence still does."""
    tokenizer = qwen3
    user, turn = {"role": "user", "content": "7 + 5?"}, "<think>\nSeven and five.\n</think>\n\n#### 11"
    sampled = _prompt(tokenizer, [user]) + _ids(tokenizer, turn) + [tokenizer.eos_token_id]
    appended = sampled + observation_ids(tokenizer, turn_wrapping(tokenizer, "user"), "too low")
    feedback = {"role": "user", "content": "too low"}
    rendered = _prompt(tokenizer, [user, {"role": "assistant", "content": turn}, feedback])
    assert appended[:len(sampled)] == sampled
    assert rendered[:len(sampled)] != sampled and _ids(tokenizer, "Seven")[0] not in rendered


@pytest.mark.parametrize("role", ["tool", "user"])
def test_an_observation_starts_after_the_end_of_turn_token(tokenizer, role):
    wrapping = turn_wrapping(tokenizer, role)
    ids = observation_ids(tokenizer, wrapping, "too low")
    im_start, assistant = tokenizer.convert_tokens_to_ids("<|im_start|>"), _ids(tokenizer, "assistant")
    assert ids[:2] == [_ids(tokenizer, "\n")[0], im_start]  # the newline the template writes after <|im_end|>
    assert ids[-3:] == [im_start, *assistant, _ids(tokenizer, "\n")[0]]  # the next turn's generation prompt
    assert tokenizer.eos_token_id in ids  # the observation's own turn is closed


def test_a_template_without_eos_is_refused():
    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "qwen2-tokenizer")
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ValueError, match="EOS"):
        turn_wrapping(tokenizer, "user")
