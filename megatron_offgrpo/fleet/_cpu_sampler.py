"""A faster exact sampler for vLLM on CPU: inverse-CDF sampling over vocabulary blocks (issue 19, item 3).

Profiled on the 2-core CPU (``offgrpo train`` with the in-process engine, 64 sequences x 64 tokens, 151,936-token
vocabulary), vLLM 0.32's CPU sampler took more of each decode step than the output layer's GEMM: its Gumbel-max
(``fused_gumbel_argmax``: a SplitMix64 draw and two logarithms per vocabulary entry) ~29 ms per step against ~8 ms
for the log-softmax it computes anyway for the log-probs (``processed_logprobs``). Sampling from those log-probs by
inverse CDF costs one exp pass and block sums: the block of the token first (a cumulative sum over ~150 block
totals), then the token within it (a cumulative sum over one block), ~10 ms. Same distribution: a token is drawn
with probability softmax(logits) up to float32 rounding, as the Gumbel draw is; tokens masked to -inf (top-k /
top-p) have probability 0 and are never drawn; a request's own generator (``SamplingParams.seed``) draws its row's
uniform.

``install()`` replaces ``TopKTopPSampler.forward_cpu`` for this process, before the engine builds its sampler
(``fleet._worker_ext`` calls it at import, which runs in every vLLM worker: the fleet's servers and the in-process
engine). If a later vLLM renames or reshapes that method, ``install`` leaves vLLM's sampler alone and logs why.
``OFFGRPO_CPU_SAMPLER=vllm`` keeps vLLM's own (to compare, or if this one is ever in doubt).

The same ``install()`` runs the sampled token's rank (part of every log-prob answer) eagerly on CPU: vLLM 0.32's
``batched_count_greater_than`` is ``torch.compile``d with inductor, which compiled it on the first request of every
engine: 3.7 s of the first generation of each in-process engine and fleet server (profiled on the 2-core CPU, a
1-step tiny ``offgrpo train``), for a comparison and a row sum that take microseconds eagerly on CPU.
"""

from __future__ import annotations

import inspect
import logging
import os

import torch

logger = logging.getLogger(__name__)

BLOCK = 1024  # vocabulary entries per block: ~150 blocks for Qwen's vocabulary; both cumulative sums stay short
SWITCH = "OFFGRPO_CPU_SAMPLER"
_SIGNATURE = ["self", "logits", "generators", "k", "p"]


def sample_from_logprobs(logprobs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One token per row of ``logprobs`` [rows, V] (log-probabilities; -inf = excluded), drawn with probability
    exp(logprobs) by inverse CDF over blocks of ``BLOCK`` entries. Rows in ``generators`` draw with their own."""
    rows, vocab = logprobs.shape
    blocks = -(-vocab // BLOCK)
    probs = logprobs.exp()
    full = (vocab // BLOCK) * BLOCK
    block_sums = probs[:, :full].view(rows, -1, BLOCK).sum(-1)
    if full < vocab:
        block_sums = torch.cat([block_sums, probs[:, full:].sum(-1, keepdim=True)], dim=1)
    ends = block_sums.cumsum(-1)
    uniform = torch.rand(rows, 1)
    for row, generator in generators.items():
        uniform[row] = torch.rand(1, generator=generator)
    target = uniform * ends[:, -1:]
    # right=True: the first block whose end exceeds the target, so a block of probability 0 is never chosen
    block = torch.searchsorted(ends, target, right=True).clamp_(max=blocks - 1)
    within = target - (ends.gather(1, block) - block_sums.gather(1, block))
    index = block * BLOCK + torch.arange(BLOCK)
    inside = index < vocab
    weights = probs.gather(1, index.clamp(max=vocab - 1)) * inside  # the tail block's missing entries weigh 0
    cumulative = weights.cumsum(-1)
    # float rounding may put the target just outside this block's [0, total): keep it inside, so that right=True
    # lands on a token of weight > 0 (never on a leading or trailing excluded one)
    within = torch.minimum(within.clamp_(min=0.0), cumulative[:, -1:] * (1 - 2**-20))
    offset = torch.searchsorted(cumulative, within, right=True).clamp_(max=BLOCK - 1)
    return (block * BLOCK + offset).view(-1)


def count_at_least(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per row of ``x`` [rows, V], how many entries are >= that row's ``values`` [rows, 1]: the sampled token's
    rank as vLLM's ``batched_count_greater_than`` counts it, without its compile."""
    return (x >= values).sum(-1)


def _forward_cpu(self, logits: torch.Tensor, generators: dict[int, torch.Generator], k: torch.Tensor | None,
                 p: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``TopKTopPSampler.forward_cpu`` with the inverse-CDF draw (vLLM's own for the modes it does not cover)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    if self.use_fp64_gumbel:  # vLLM's fp64 path: keep it
        return _VLLM_FORWARD_CPU(self, logits, generators, k, p)
    logits = apply_top_k_top_p(logits, k, p)
    logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)
    returned = {"processed_logits": logits, "processed_logprobs": logprobs}.get(self.logprobs_mode)
    return sample_from_logprobs(logprobs, generators), returned


_VLLM_FORWARD_CPU = None


def install() -> bool:
    """Use ``sample_from_logprobs`` in vLLM's CPU sampler in this process; True if it is in place."""
    global _VLLM_FORWARD_CPU
    if os.environ.get(SWITCH, "").lower() == "vllm":
        return False
    try:
        from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler, apply_top_k_top_p  # noqa: F401
    except ImportError as exc:
        logger.warning("vLLM's CPU sampler kept: %s", exc)
        return False
    current = getattr(TopKTopPSampler, "forward_cpu", None)
    if current is _forward_cpu:
        return True
    if current is None or list(inspect.signature(current).parameters) != _SIGNATURE:
        logger.warning("vLLM's CPU sampler kept: TopKTopPSampler.forward_cpu is not the one this sampler replaces "
                       "(vLLM 0.32's (self, logits, generators, k, p))")
        return False
    _VLLM_FORWARD_CPU = current
    TopKTopPSampler.forward_cpu = _forward_cpu
    _install_rank_count()
    return True


def _install_rank_count() -> None:
    """``count_at_least`` for the rank of each sampled or prompt token in vLLM's sampler module, where it names the
    compiled ``batched_count_greater_than`` (kept, with a log line, if a later vLLM no longer does). CPU only: on
    a GPU the compiled kernel is what spares a [rows, V] temporary."""
    from vllm.platforms import current_platform
    from vllm.v1.sample import sampler

    if not current_platform.is_cpu():
        return

    current = getattr(sampler, "batched_count_greater_than", None)
    if current is count_at_least:
        return
    if current is None or getattr(current, "__name__", "") != "batched_count_greater_than":
        logger.warning("vLLM's token rank kept (compiled at the first request): vllm.v1.sample.sampler has no "
                       "batched_count_greater_than to replace")
        return
    sampler.batched_count_greater_than = count_at_least


def sampler_name(model_runner) -> str:
    """Which sampler ``model_runner`` (a vLLM worker's) draws tokens with."""
    sampler = getattr(getattr(model_runner, "sampler", None), "topk_topp_sampler", None)
    forward = getattr(sampler, "forward", None)
    return "offgrpo-inverse-cdf" if getattr(forward, "__func__", None) is _forward_cpu else "vllm"
