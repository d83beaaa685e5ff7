"""Prompts for the fleet: chat template from the tokenizer (or plain text for base models), and a resumable,
epoch-shuffled prompt stream."""

from __future__ import annotations

import random
from typing import Sequence

from megatron_offgrpo.data._datasets import QARecord
from megatron_offgrpo.data._types import Prompt

DEFAULT_INSTRUCTION = "Solve the problem. Put the final numeric answer after '####'."
PROMPT_FORMATS = ("chat", "plain")


def build_prompt(record: QARecord, tokenizer, system_prompt: str | None = None,
                 instruction: str = DEFAULT_INSTRUCTION, max_prompt_tokens: int | None = None,
                 prompt_format: str = "chat", tools: list[dict] | None = None) -> Prompt:
    """Tokenise one record: with the tokenizer's chat template (generation prompt appended), or as ``plain`` text
    (system prompt, question and instruction on their own lines, no special tokens: base-model style).

    ``tools`` (chat only): the tools a multi-turn environment offers, in the template's ``tools=`` form
    (``envs.ToolSpec.as_template_tool``): Qwen's templates list them in the system turn with the call format.

    Raises:
        ValueError: an unknown format, a chat format with a tokenizer without a chat template, or a prompt longer
            than ``max_prompt_tokens``.
    """
    user = f"{record.question}\n{instruction}".strip()
    if prompt_format == "plain":
        ids = tokenizer.encode(f"{system_prompt}\n{user}" if system_prompt else user, add_special_tokens=False)
    elif prompt_format == "chat":
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat_template; use a chat/instruct tokenizer (e.g. Qwen2.5's) "
                             "or data.prompt_format=plain")
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": user}]
        ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers >= 5 may return a BatchEncoding
            ids = ids["input_ids"]
    else:
        raise ValueError(f"prompt format {prompt_format!r}: expected one of {list(PROMPT_FORMATS)}")
    if tools and prompt_format != "chat":
        raise ValueError("tools need the chat template (data.prompt_format=chat): a plain prompt cannot announce them")
    if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
        raise ValueError(f"prompt {record.record_id} has {len(ids)} tokens > "
                         f"data.max_prompt_tokens={max_prompt_tokens}")
    return Prompt(record.record_id, tuple(int(i) for i in ids), record.question, record.answer,
                  record.max_new_tokens)


class PromptStream:
    """Endless batches of prompts: each epoch visits every prompt once in a seeded shuffle. Resumable."""

    def __init__(self, prompts: Sequence[Prompt], seed: int = 0) -> None:
        """Args: prompts: the dataset (non-empty). seed: shuffle seed; epoch e uses ``seed + e``."""
        if not prompts:
            raise ValueError("the prompt dataset is empty")
        self._prompts = list(prompts)
        self._seed = seed
        self.epoch, self.position = 0, 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self._prompts)))
        random.Random(self._seed + epoch).shuffle(order)
        return order

    def next_batch(self, size: int) -> list[Prompt]:
        """The next ``size`` prompts, crossing into the next epoch when this one runs out."""
        batch = []
        while len(batch) < size:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._shuffled(self.epoch)
            batch.append(self._prompts[self._order[self.position]])
            self.position += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        """Where the stream is (saved with checkpoints)."""
        return {"epoch": self.epoch, "position": self.position, "seed": self._seed, "size": len(self._prompts)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position.

        Raises:
            ValueError: the saved stream had another size or seed (a different dataset or config).
        """
        if state["size"] != len(self._prompts) or state["seed"] != self._seed:
            raise ValueError(
                f"prompt stream state is for {state['size']} prompts with seed {state['seed']}, "
                f"this run has {len(self._prompts)} with seed {self._seed}: resume with the same data and seed"
            )
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._shuffled(self.epoch)
