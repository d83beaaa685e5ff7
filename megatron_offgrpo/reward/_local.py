"""Reward models in rank 0's process (transformers, CPU): small classifiers and judges, no server to run.

Both hold one lock: groups are scored from several threads, and a torch module is not meant to run two forwards at
once. Every forward runs in fp32 under ``inference_mode``.
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch

from megatron_offgrpo.reward._types import ModelScore, RewardModelError, ScoreRequest

BATCH = 16
"""Completions per classifier forward (left-padded to the longest)."""


class LocalClassifier:
    """A sequence classifier with one label; its logit at the last token of prompt + response is the score.

    The last token is read directly (vLLM's pooling does the same): HF's own pooling looks for the last token that
    is not ``pad_token_id``, which for a Qwen tokenizer (pad = EOS) is the token before a response's EOS.
    """

    def __init__(self, path: str) -> None:
        """Raises ``RewardModelError`` for a model that is not a one-label classifier with a ``score`` head."""
        import transformers

        self.name = path
        self.model = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
        labels = self.model.config.num_labels
        if labels != 1 or not hasattr(self.model, "score"):
            raise RewardModelError(f"reward.model={path}: a classifier with {labels} labels"
                                   f"{'' if hasattr(self.model, 'score') else ' and no score head'}; a reward model "
                                   "has one label (its logit is the reward) on a Qwen-family model")
        self._lock = threading.Lock()

    def score(self, requests: Sequence[ScoreRequest]) -> list[ModelScore]:
        scores: list[ModelScore] = []
        for start in range(0, len(requests), BATCH):
            chunk = [list(r.token_ids) for r in requests[start:start + BATCH]]
            scores += [ModelScore(float(v)) for v in self.logits(chunk)]
        return scores

    def logits(self, sequences: list[list[int]]) -> list[float]:
        """The score head's output at each sequence's last token (sequences left-padded, positions from 0)."""
        width = max(len(s) for s in sequences)
        ids = torch.tensor([[0] * (width - len(s)) + s for s in sequences])
        mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with self._lock, torch.inference_mode():
            hidden = self.model.base_model(input_ids=ids, attention_mask=mask, position_ids=positions)
            return self.model.score(hidden.last_hidden_state[:, -1]).float()[:, 0].tolist()

    def close(self) -> None:
        pass


class LocalJudgeModel:
    """A causal LM that replies to a judge's prompts: greedy, or sampled from a ``torch.Generator`` seeded per
    request (the global RNG is shared with other threads: a seeded sample must not depend on them, nor on the
    other prompts of its batch)."""

    def __init__(self, path: str) -> None:
        import transformers

        self.name = path
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.eos = _eos_ids(self.model.generation_config.eos_token_id)
        self._lock = threading.Lock()

    def replies(self, prompts: Sequence[list[int]], max_tokens: int, temperature: float, seeds: Sequence[int],
                top: int) -> list[tuple[list[int], dict[int, float]]]:
        """The prompts' replies, decoded together (left-padded, one KV cache), each sampled from its own generator;
        each with the ``top`` most likely first tokens' log-probs."""
        generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        tokens: list[list[int]] = [[] for _ in prompts]
        firsts: list[dict[int, float]] = [{} for _ in prompts]
        done, cache = [False] * len(prompts), None
        with self._lock, torch.inference_mode():
            for step in range(max_tokens):
                out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                                 use_cache=True)
                cache, logits = out.past_key_values, out.logits[:, -1].float()
                if step == 0:
                    values, indices = torch.log_softmax(logits, -1).topk(top)
                    firsts = [dict(zip(i.tolist(), v.tolist())) for i, v in zip(indices, values)]
                chosen = []
                for k, row in enumerate(logits):
                    if done[k]:  # finished rows decode on (the batch is one tensor) but keep nothing
                        chosen.append(0)
                        continue
                    token = int(row.argmax()) if temperature == 0 else int(
                        torch.multinomial(torch.softmax(row / temperature, -1), 1, generator=generators[k]))
                    tokens[k].append(token)
                    done[k] = token in self.eos
                    chosen.append(token)
                if all(done):
                    break
                ids = torch.tensor(chosen)[:, None]
                mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], -1)
                positions = positions[:, -1:] + 1
        return list(zip(tokens, firsts))

    def close(self) -> None:
        pass


def _eos_ids(value: int | list[int] | None) -> frozenset[int]:
    if value is None:
        return frozenset()
    return frozenset([value] if isinstance(value, int) else value)
