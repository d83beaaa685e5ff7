"""The reward model itself: a one-label HF sequence classifier (``Qwen2ForSequenceClassification``) whose backbone is
the policy's and whose score head is new; trained in plain torch on CPU, scored, written as a HF directory.

Shape notation: S completions (prompt + response ids each, right-padded to the longest, T). The classifier's logit
is read at each sequence's last token that is not the pad id (HF's pooling): a batch and a lone sequence give the
same score, so what the fitter reports is what ``AutoModelForSequenceClassification`` computes on the directory.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Callable, Iterator, Literal, Sequence

import torch

from megatron_offgrpo.rmfit._losses import rm_loss
from megatron_offgrpo.rmfit._samples import LabelledGroup

logger = logging.getLogger(__name__)

SCORE_BATCH = 64
"""Sequences per forward when scoring (no gradient)."""


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' load report at error level only, and no progress bars: a classifier made from a causal LM
    always has a new head and an unused output layer, and says so in a warning each time."""
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def build_classifier(policy_dir: Path, pad_token_id: int, seed: int, freeze_embeddings: bool) -> torch.nn.Module:
    """The policy's backbone under a new one-logit head drawn from ``seed`` (normal, the config's initializer
    range: what a fresh HF head gets, but from our generator), in float32; the embeddings frozen when asked."""
    from transformers import AutoModelForSequenceClassification

    with _quiet_transformers():
        model = AutoModelForSequenceClassification.from_pretrained(
            policy_dir, num_labels=1, pad_token_id=pad_token_id, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head = model.score.weight
        head.copy_(torch.randn(head.shape, generator=generator) * model.config.initializer_range)
    if freeze_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    return model


def _padded(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([S, T] ids right-padded with ``pad_id``, [S, T] attention mask: True on real tokens)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for row, seq in enumerate(sequences):
        ids[row, :len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[row, :len(seq)] = True
    return ids, mask


def forward_scores(model: torch.nn.Module, sequences: Sequence[Sequence[int]], pad_id: int) -> torch.Tensor:
    """[S] the classifier's logit of each sequence."""
    ids, mask = _padded(sequences, pad_id)
    return model(input_ids=ids, attention_mask=mask.long()).logits[:, 0]


def score_sequences(model: torch.nn.Module, sequences: Sequence[Sequence[int]], pad_id: int) -> list[float]:
    """The logit of each sequence, ``SCORE_BATCH`` at a time, in eval mode without gradients."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        scores = [s for start in range(0, len(sequences), SCORE_BATCH)
                  for s in forward_scores(model, sequences[start:start + SCORE_BATCH], pad_id).tolist()]
    model.train(was_training)
    return scores


def batch_order(count: int, per_step: int, steps: int, seed: int) -> list[list[int]]:
    """``steps`` batches of ``per_step`` indices into ``count`` items: a seeded permutation per epoch, walked in
    order, a new permutation when one runs out (a batch may span two epochs)."""
    generator = torch.Generator().manual_seed(seed)
    stream: list[int] = []
    batches = []
    for _ in range(steps):
        while len(stream) < per_step:
            stream += torch.randperm(count, generator=generator).tolist()
        batches.append(stream[:per_step])
        stream = stream[per_step:]
    return batches


def train_classifier(model: torch.nn.Module, groups: Sequence[LabelledGroup], loss: Literal["bce", "pairwise"],
                     steps: int, lr: float, weight_decay: float, clip_grad: float, groups_per_step: int, seed: int,
                     pad_id: int, on_step: Callable[[int, float], None]) -> list[float]:
    """``steps`` AdamW steps over batches of whole groups (``pairwise``: only groups with both labels, the others
    hold no pair); ``on_step(step, loss)`` after each. Returns the loss of every step.

    Deterministic: the batches come from ``seed`` and torch's deterministic algorithms are on while it runs.
    """
    usable = list(groups) if loss == "bce" else [g for g in groups if 0 < sum(g.labels) < len(g.labels)]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    model.train()
    losses = []
    try:
        for step, batch in enumerate(batch_order(len(usable), min(groups_per_step, len(usable)), steps, seed), 1):
            chosen = [usable[i] for i in batch]
            sequences = [seq for g in chosen for seq in g.sequences]
            labels = torch.tensor([y for g in chosen for y in g.labels])
            group_ids = torch.tensor([i for i, g in enumerate(chosen) for _ in g.responses])
            value = rm_loss(loss, forward_scores(model, sequences, pad_id), labels, group_ids)
            optimizer.zero_grad(set_to_none=True)
            value.backward()
            if clip_grad > 0:
                torch.nn.utils.clip_grad_norm_(params, clip_grad)
            optimizer.step()
            losses.append(value.item())
            on_step(step, losses[-1])
    finally:
        torch.use_deterministic_algorithms(deterministic)
    model.eval()
    return losses


def save_classifier(model: torch.nn.Module, tokenizer, out: Path) -> Path:
    """The classifier as a HF directory ``out``: config (one label, the pad id), safetensors weights, and the
    policy's tokenizer (``AutoTokenizer`` loads it from ``out``)."""
    out.mkdir(parents=True, exist_ok=True)
    with _quiet_transformers():
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    return out
