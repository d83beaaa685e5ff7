"""Token-in / token-out turns: the tokens an environment's message adds after the model's turn, from the chat template.

A multi-turn episode is one token sequence: prompt, turn 1 (sampled), observation 1 (the environment's), turn 2, ...
Only the observations are tokenised here, each alone: the model's tokens are never decoded and encoded again, so the
tokens trained on are the tokens sampled (re-rendering the conversation through the template would not give them
back: a template may strip ``<think>`` from earlier turns, and BPE does not round-trip an arbitrary token string).

The observation's wrapping comes from the template itself, as the difference of two renderings: a conversation
ending in a user message, and the same with the observation appended (and the generation prompt). A user message
renders the same whatever follows it in the templates of Qwen2.5 and Qwen3, so the first is a prefix of the second
(checked: a template where it is not is refused). The model's turn ends with the end-of-turn token it sampled (EOS,
``<|im_end|>``); what the template writes after that token (Qwen: a newline) comes first.
"""

from __future__ import annotations

import dataclasses

_PROBE = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]


@dataclasses.dataclass(frozen=True)
class TurnWrapping:
    """The text a chat template puts around an environment message appended after the model's end-of-turn token.

    Attributes:
        before: between the model's end-of-turn token and the message (Qwen2.5, role "tool":
            ``"\\n<|im_start|>user\\n<tool_response>\\n"``).
        after: after the message, the next turn's generation prompt included
            (``"\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n"``).
    """

    before: str
    after: str

    def render(self, text: str) -> str:
        return self.before + text + self.after


def _text(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


PLAIN = TurnWrapping("\n", "\n")
"""Plain-text prompts (``data.prompt_format=plain``, base-model style): the message on a line of its own."""


def turn_wrapping(tokenizer, role: str) -> TurnWrapping:
    """How ``tokenizer``'s chat template wraps a message of ``role`` ("user" or "tool") that follows a model turn
    (``PLAIN`` is the wrapping of plain-text prompts, which have no template).

    Raises:
        ValueError: the tokenizer has no chat template or no EOS token, or its template renders a user message
            differently depending on what follows (then no suffix of it can be appended token by token).
    """
    if not getattr(tokenizer, "chat_template", None) or not tokenizer.eos_token:
        raise ValueError("multi-turn episodes need a tokenizer with a chat template and an EOS token (the model's "
                         "end-of-turn): use a chat/instruct tokenizer such as Qwen2.5's or Qwen3's")
    marker = "\x00OBSERVATION\x00"  # no template writes this: it marks where the message sits
    base = _text(tokenizer, _PROBE, False)
    full = _text(tokenizer, _PROBE + [{"role": role, "content": marker}], True)
    if not full.startswith(base) or full.count(marker) != 1:
        raise ValueError(f"the chat template renders a {role!r} message in a way that changes what comes before it: "
                         "the environment's tokens cannot be appended to the sampled ones")
    eos = tokenizer.eos_token
    if not base.rstrip().endswith(eos):
        raise ValueError(f"the chat template does not end a message with the EOS token {eos!r}: the model's "
                         "end-of-turn token is unknown")
    tail = base[base.rindex(eos) + len(eos):]  # what the template writes after an end-of-turn token
    before, after = full[len(base):].split(marker)
    return TurnWrapping(tail + before, after)


def observation_ids(tokenizer, wrapping: TurnWrapping, text: str) -> list[int]:
    """The token ids of one environment message, wrapped, tokenised alone (to append after the model's EOS)."""
    ids = tokenizer.encode(wrapping.render(text), add_special_tokens=False)
    return [int(i) for i in ids]
