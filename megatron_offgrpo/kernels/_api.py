"""The public fused loss: hidden states x output-layer shard -> vocab-parallel log-probs -> GRPO loss and grads.

It computes the function ``algo.reference_loss(hidden @ W^T, ...)`` (logits gathered over the TP group) without ever
holding the [N, V] logits: tokens are processed in chunks (see ``_driver``), the objective comes from
``algo.loss_parts.token_loss`` per chunk and the aggregation from ``algo.loss_parts.aggregate``. Gradients are
computed eagerly in the forward (the aggregation normaliser is known up front), stored, and scaled by the incoming
gradient in backward.

Shape notation: N tokens flattened over the packed batch, S sequences in the pack, H hidden, V vocabulary,
V/tp rows of this rank's vocab shard (rank r holds global ids ``[r V/tp, (r + 1) V/tp)``, as megatron's
``VocabParallelEmbedding`` / ``ColumnParallelLinear`` output layer).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from megatron_offgrpo.algo import ObjectiveParams, loss_parts
from megatron_offgrpo.kernels._checks import (
    check_is_inputs,
    check_linear,
    check_options,
    check_target_range,
    check_targets,
)
from megatron_offgrpo.kernels._driver import Run, TokenBatch, fused_loss_and_grads, iterate_chunks
from megatron_offgrpo.kernels._prepare import prepare_batch
from megatron_offgrpo.kernels._tp import group_size_rank
from megatron_offgrpo.kernels._triton_ops import triton_usable

Count = Union[float, int, torch.Tensor]  # as in loss_parts.aggregate: a (data-parallel) count, float or 0-dim tensor

DEFAULT_CHUNK_BYTES = 256 << 20
"""Default size of the [chunk, V/tp] logits buffer(s): 256 MiB. At Qwen2.5's V = 151,936 (tp = 1, float32) that is
441 tokens per chunk: forward+backward at N = 2048 measured 1.06-1.10x the three unchunked GEMMs on a 2-core CPU
(220-token chunks: 1.10-1.24x; 882: 1.04-1.09x)."""


def resolve_impl(impl: str, device: torch.device) -> str:
    """``"auto"`` -> ``"triton"`` on CUDA when Triton is importable, else ``"torch"``; checks an explicit choice."""
    if impl == "auto":
        return "triton" if device.type == "cuda" and triton_usable(device)[0] else "torch"
    if impl == "triton":
        ok, why = triton_usable(device)
        if not ok:
            raise ValueError(f"impl='triton' cannot run: {why}")
    return impl


def default_chunk_size(weight: torch.Tensor, impl: str) -> int:
    """Tokens per chunk so that the logits buffer(s) take about ``DEFAULT_CHUNK_BYTES``."""
    per_token = weight.shape[0] * weight.element_size()
    if impl == "torch" and weight.dtype != torch.promote_types(weight.dtype, torch.float32):
        per_token += weight.shape[0] * 4  # the float32 softmax buffer next to the 16-bit logits
    return max(1, DEFAULT_CHUNK_BYTES // per_token)


def _make_run(hidden, weight, tp_group, temperature, chunk_size, impl, entropy, exact: bool = False) -> Run:
    check_linear(hidden, weight)
    check_options(temperature, chunk_size, impl, tp_group)
    impl = "torch" if exact else resolve_impl(impl, hidden.device)  # float64 statistics: the torch path only
    chunk = chunk_size if chunk_size is not None else default_chunk_size(weight, impl)
    stats = torch.float64 if exact else None
    return Run(hidden, weight, tp_group, float(temperature), chunk, impl, bool(entropy), stats)


class _FusedLinearLoss(torch.autograd.Function):
    """Autograd wrapper: the forward computes loss and grads; the backward scales the stored grads."""

    @staticmethod
    def forward(ctx, hidden, weight, run: Run, batch: TokenBatch, params: ObjectiveParams, sink: dict, grad_mode):
        # needs_input_grad stays True under torch.no_grad(); grad_mode (taken outside) skips the gradient work there
        need_h, need_w = (grad_mode and needs for needs in ctx.needs_input_grad[:2])
        with torch.no_grad():
            loss, sums, grad_h, grad_w = fused_loss_and_grads(run, batch, params, need_h, need_w)
        ctx.grads = (grad_h, grad_w)
        sink.update(sums)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        if ctx.grads is None:
            raise RuntimeError(
                "backward through fused_linear_grpo_loss ran twice; its gradients are precomputed and handed out "
                "once: recompute the loss instead of retain_graph=True"
            )
        grad_h, grad_w = ctx.grads
        ctx.grads = None
        # Always scaled (one pass over the grads): asking whether grad_loss == 1 would be a host synchronisation,
        # and the pipeline schedule passes 1 / num_microbatches, for instance.
        grad_h = grad_h.mul_(grad_loss.to(grad_h.dtype)) if grad_h is not None else None
        grad_w = grad_w.mul_(grad_loss.to(grad_w.dtype)) if grad_w is not None else None
        return grad_h, grad_w, None, None, None, None, None


def fused_linear_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    behavior_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    params: ObjectiveParams,
    *,
    ref_logp: Optional[torch.Tensor] = None,
    fleet_logp: Optional[torch.Tensor] = None,
    tis_weights: Optional[torch.Tensor] = None,
    seq_ids: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    global_token_count: Optional[Count] = None,
    global_seq_count: Optional[Count] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
    chunk_size: Optional[int] = None,
    impl: str = "auto",
    valid_rows: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``algo.reference_loss`` of the logits ``hidden @ weight^T`` (all TP shards), without materialising them.

    Backward (at most once per call) gives the grads of ``hidden``, summed over the TP group (so do NOT also route
    ``hidden`` through megatron's ``copy_to_tensor_model_parallel_region``), and of this rank's ``weight`` shard.
    Every TP rank returns the same loss and metrics.

    Args:
        hidden: [N, H] hidden states after the final norm (float32, bfloat16, float16 or float64).
        weight: [V/tp, H] this rank's output-layer shard (tied embedding or separate head), same dtype.
        targets: [N] global id of the sampled next token (any value where ``loss_mask`` is False).
        behavior_logp: [N] log-probs under the behavior policy that generated the samples.
        advantages: [N] per-token advantages.
        loss_mask: [N] bool, True = response token of a valid sample (enters the loss and its normaliser).
        params: objective switches (objective kind, clip eps, dual clip, KL estimator and beta, TIS, aggregation).
        ref_logp: [N] reference-policy log-probs (KL term / metric).
        fleet_logp: [N] the fleet's log-probs: truncated-IS weights and statistics as in ``reference_loss``.
        tis_weights: [N] precomputed truncated-IS weights (instead of ``fleet_logp``).
        seq_ids: [N] sequence id per token (``seq_mean_token_mean``, sequence-level TIS); or ``cu_seqlens`` [S + 1].
        cu_seqlens: [S + 1] packed boundaries (alternative to ``seq_ids``).
        temperature: sampling temperature T > 0 the logits are divided by.
        compute_entropy: also report the mean entropy of ``softmax(logits / T)`` over valid tokens.
        global_token_count: see ``algo.loss_parts.aggregate``.
        global_seq_count: see ``algo.loss_parts.aggregate``.
        tp_group: the tensor-parallel group the vocabulary is split over; None = no TP.
        chunk_size: tokens per chunk; None = about ``DEFAULT_CHUNK_BYTES`` of logits buffer.
        impl: ``"torch"`` (any device), ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``) or ``"auto"``.
        valid_rows: [n] the indices where ``loss_mask`` is True, ascending, when the caller knows them (the trainer
            finds them on the CPU when it builds a micro-batch). With them the call makes no host synchronisation:
            finding the rows and scanning the targets for ids outside ``[0, V)`` are then the caller's work (the
            trainer checks its targets on the CPU too, ``MicroBatch.check_targets``). Without them, one each.

    Returns:
        ``(loss 0-dim, metrics)`` with the keys of ``reference_loss``: raw sums, ``finalize_metrics`` and ``loss``.

    Raises:
        ValueError: on malformed inputs (named), a target id outside ``[0, V)``, or an unusable ``impl``.
    """
    run = _make_run(hidden, weight, tp_group, temperature, chunk_size, impl, compute_entropy)
    targets = check_targets(targets, hidden.shape[0])
    check_is_inputs(fleet_logp, tis_weights)
    optional = {"ref_logp": ref_logp, "fleet_logp": fleet_logp, "tis_weights": tis_weights}
    norms = {"seq_ids": seq_ids, "cu_seqlens": cu_seqlens, "global_token_count": global_token_count,
             "global_seq_count": global_seq_count}
    batch, sums = prepare_batch(targets, behavior_logp, advantages, loss_mask, params, run.acc_dtype, optional, norms,
                                valid_rows)
    if valid_rows is None:
        check_target_range(batch.targets, weight.shape[0] * group_size_rank(tp_group)[0])
    sink: dict[str, torch.Tensor] = {}
    loss = _FusedLinearLoss.apply(hidden, weight, run, batch, params, sink, torch.is_grad_enabled())
    sums.update(sink)
    return loss, {**sums, **loss_parts.finalize_metrics(sums), "loss": loss.detach()}


@torch.no_grad()
def vocab_parallel_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    tp_group: Optional[dist.ProcessGroup] = None,
    chunk_size: Optional[int] = None,
    impl: str = "auto",
    exact: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs of the targets (and entropies) under ``softmax(hidden @ W^T / T)``, chunked, without grads.

    For the trainer's own log-probs of the behavior or reference weights (e.g. for truncated IS), and with ``exact``
    for the refresh probe: the log-softmax of the (fp32) logits in float64, so the result does not depend on how the
    vocabulary is split or summed. In fp32 the sum over V exps of one row carries a rounding bias that grows with the
    terms per accumulator: measured 5.3e-4 at V = 151,936 on one CPU, half that over each TP2 shard.

    Args:
        hidden: [N, H] hidden states after the final norm.
        weight: [V/tp, H] this rank's output-layer shard, same dtype.
        targets: [N] global token ids in ``[0, V)``.
        temperature: T > 0.
        compute_entropy: also return the per-token entropy.
        tp_group: the TP group of the vocab split, or None.
        chunk_size: tokens per chunk; None = by memory.
        impl: ``"auto"``, ``"torch"`` or ``"triton"`` (``exact`` runs the torch path).
        exact: softmax statistics in float64 ([chunk, V/tp] float64 buffer; for a few tokens, such as the probe).

    Returns:
        ``(logp [N], entropy [N] or None)`` in float32 (float64 for float64 inputs or ``exact``); identical on every
        TP rank.

    Raises:
        ValueError: on malformed inputs or a target id outside ``[0, V)``.
    """
    run = _make_run(hidden, weight, tp_group, temperature, chunk_size, impl, compute_entropy, exact)
    targets = check_targets(targets, hidden.shape[0])
    check_target_range(targets, weight.shape[0] * group_size_rank(tp_group)[0])
    logp = torch.empty(targets.shape[0], dtype=run.acc_dtype, device=hidden.device)
    entropy = torch.empty_like(logp) if compute_entropy else None
    for chunk, _ in iterate_chunks(run, TokenBatch(rows=None, targets=targets)):
        logp[chunk.start : chunk.end] = chunk.stats.target_logit - chunk.stats.lse
        if entropy is not None and chunk.stats.entropy is not None:
            entropy[chunk.start : chunk.end] = chunk.stats.entropy
    return logp, entropy
