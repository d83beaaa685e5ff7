"""A micro-batch without a valid token, for every objective (KL and truncated IS on where they apply), and GSPO's clip
decided once per sequence; the torch path here, the Triton path under the interpreter (``_triton_interp``, run by
test_kernels_triton.py). ``algo.reference_loss`` is the oracle.

- all masked: loss 0, zero gradients, metrics equal to the reference's (zeros, never NaN).
- an all-masked micro-batch beside a normal one, each called with the global counts (as the trainer does): the summed
  losses and gradients are the reference's on the two concatenated (tolerance: test_kernels_fused_loss's TOL).
- GSPO on a clip edge: the edge ``1 + seq_eps_high`` (or ``1 - seq_eps_low``) is set to one sequence's ratio ``s`` as
  the path itself computes it, so ``s == edge`` exactly; at the edge a token counts as unclipped, so every token of that
  sequence keeps its gradient, and in every sequence either all valid tokens are clipped (zero gradient) or none.
"""

from __future__ import annotations

import contextlib
import importlib
import types
from typing import Iterator

import pytest
import torch

from megatron_offgrpo.algo import ObjectiveParams
from tests.kernels._cases import Case, make_case, rel_err
from tests.kernels.test_kernels_fused_loss import TOL, loss_scale, run_fused, run_reference

SEQ = dict(aggregation="seq_mean_token_mean")
OBJECTIVES = {  # every registered objective, with KL (a different estimator here and there) and truncated IS
    "grpo_clip": ObjectiveParams(kl_beta=0.05, dual_clip=3.0, tis_cap=2.0),
    "gpg": ObjectiveParams(objective="gpg", kl_beta=0.05, kl_estimator="k1", tis_cap=2.0,
                           aggregation="token_sum_norm", aggregation_constant=20.0),
    "rec": ObjectiveParams(objective="rec", rec_weight="is", rec_clip="one_side", kl_beta=0.05, tis_cap=2.0,
                           tis_level="sequence", **SEQ),
    "opmd": ObjectiveParams(objective="opmd", tau=0.1, kl_beta=0.02, kl_estimator="k2", tis_cap=2.0),
    "asymre": ObjectiveParams(objective="asymre", tau=0.05, kl_beta=0.05, tis_cap=2.0),
    "cispo": ObjectiveParams(objective="cispo", eps_low=1.0, eps_high=0.28, kl_beta=0.05, tis_cap=2.0),
    "gspo": ObjectiveParams(objective="gspo", seq_eps_low=0.05, seq_eps_high=0.05, kl_beta=0.05, tis_cap=2.0,
                            tis_level="sequence", **SEQ),
}
SHAPE = dict(groups=2, group_size=4, seq_len=5, with_fleet=True, entropy=True)  # 40 tokens, 3 response tokens each
CHUNK = 4  # splits sequences over chunks


def _masked_case(name: str) -> Case:
    case = make_case(seed=1, params=OBJECTIVES[name], zero_variance_groups=2, **SHAPE)  # every group masked
    assert not case.loss_mask.any()
    return case


def all_masked(name: str, impl: str) -> dict:
    """The fused loss of an all-masked micro-batch: its loss, largest gradient entry and metrics vs the reference."""
    case = _masked_case(name)
    _, ref_metrics, _, _ = run_reference(case)
    loss, metrics, gh, gw = run_fused(case, CHUNK, impl=impl)
    same = set(metrics) == set(ref_metrics) and all(
        bool(torch.isfinite(metrics[k]).all()) and torch.allclose(metrics[k], v, rtol=0, atol=0)
        for k, v in ref_metrics.items())
    return {"loss": loss.item(), "grad_max": max(gh.abs().max().item(), gw.abs().max().item()), "metrics": same}


def _concat(first: Case, second: Case) -> Case:
    """``first`` then ``second`` as one batch over ``second``'s output layer (sequence ids kept distinct)."""
    kw = {}
    for key, value in second.kwargs.items():
        if isinstance(value, torch.Tensor):
            shift = int(first.kwargs["seq_ids"].max()) + 1 if key == "seq_ids" else 0
            kw[key] = torch.cat([first.kwargs[key], value + shift])
        else:
            kw[key] = value
    cat = [torch.cat([getattr(first, f), getattr(second, f)])
           for f in ("hidden", "targets", "behavior_logp", "advantages", "loss_mask")]
    return Case(cat[0], second.weight, *cat[1:], second.params, kw)


def mixed(name: str, impl: str) -> dict:
    """An all-masked micro-batch and a normal one through the fused loss with the global counts, summed, against
    the reference on the whole batch: errors of the loss (relative to its scale) and of both gradients."""
    empty = _masked_case(name)
    empty.weight = (full := make_case(seed=2, params=OBJECTIVES[name], zero_variance_groups=0, **SHAPE)).weight
    whole = _concat(empty, full)
    ids = whole.kwargs["seq_ids"]
    counts = {"global_token_count": float(whole.loss_mask.sum()),
              "global_seq_count": float(torch.unique(ids[whole.loss_mask]).numel())}
    ref_loss, _, ref_gh, ref_gw = run_reference(whole)
    parts = [run_fused(part, CHUNK, impl=impl, **counts) for part in (empty, full)]
    loss = parts[0][0] + parts[1][0]
    gh, gw = torch.cat([parts[0][2], parts[1][2]]), parts[0][3] + parts[1][3]
    scale = max(abs(ref_loss.item()), loss_scale(whole))
    return {"loss": abs(loss.item() - ref_loss.item()) / scale, "grad_hidden": rel_err(gh, ref_gh),
            "grad_weight": rel_err(gw, ref_gw), "empty_grad_max": parts[0][2].abs().max().item()}


@contextlib.contextmanager
def _spy_sequence_ratio(module_name: str) -> Iterator[list]:
    """Records ``(ratio, loss mask, seq_ids)`` of every ``sequence_log_ratio`` call made by ``module_name`` (which
    calls it as ``objectives.sequence_log_ratio``: that module alone sees the spy, through a namespace of its own)."""
    module = importlib.import_module(module_name)
    # the kernel calls ``objectives.sequence_log_ratio`` (algo's namespace), the reference its own import of it
    owner = module if hasattr(module, "sequence_log_ratio") else types.SimpleNamespace(**vars(module.objectives))
    real, seen = owner.sequence_log_ratio, []

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append((out, args[2], kwargs["seq_ids"]))
        return out

    owner.sequence_log_ratio = spy
    swapped = owner is not module
    if swapped:
        real_objectives, module.objectives = module.objectives, owner
    try:
        yield seen
    finally:
        if swapped:
            module.objectives = real_objectives
        else:
            module.sequence_log_ratio = real


def gspo_edges(path: str) -> list[dict]:
    """GSPO through ``path`` ("reference", "torch" or "triton") with one sequence's ratio exactly on the low clip
    edge, then another's on the high one (sequences whose clip can act: A and log s of one sign): what each run kept
    and clipped."""
    case = make_case(seed=3, groups=3, group_size=4, seq_len=8, zero_variance_groups=0, with_ref=False,
                     params=ObjectiveParams(objective="gspo", **SEQ))
    module = "megatron_offgrpo.algo._reference" if path == "reference" else "megatron_offgrpo.kernels._driver"
    run = run_reference if path == "reference" else (lambda c: run_fused(c, 5, impl=path))
    with _spy_sequence_ratio(module) as seen:
        run(case)  # this path's own sequence ratios (deterministic: a second run computes the same floats)
    ratio, valid, seq_ids = seen[-1]
    ratio_of = {int(i): ratio[valid & (seq_ids == i)][0] for i in seq_ids[valid].unique()}  # one float per sequence
    ids, mask = case.kwargs["seq_ids"], case.loss_mask  # the kernel compacts the tokens but keeps their sequence ids
    adv_of = {i: case.advantages[mask & (ids == i)][0].item() for i in ratio_of}
    acting = [i for i in ratio_of if ratio_of[i].item() != 0 and (adv_of[i] > 0) == (ratio_of[i].item() > 0)]
    results = []
    for edge in [next(i for i in acting if ratio_of[i] < 0), next(i for i in acting if ratio_of[i] > 0)]:
        s = torch.exp(ratio_of[edge]).item()  # the ratio as the objective sees it (a float32, exact in float64)
        side = {"seq_eps_high": s - 1.0} if s > 1 else {"seq_eps_low": 1.0 - s}
        case.params = ObjectiveParams(objective="gspo", **side, **SEQ)
        assert (1.0 + case.params.seq_eps_high if s > 1 else 1.0 - case.params.seq_eps_low) == s  # exactly on it
        _, metrics, gh, _ = run(case)
        kept = gh.abs().amax(1) > 0  # [N] True = the token kept a gradient (unclipped)
        clipped = (metrics["clip_low_count"] + metrics["clip_high_count"]).item()
        results.append({
            "edge": edge, "side": next(iter(side)), "edge_kept": bool(kept[mask & (ids == edge)].all()),
            "split_sequences": [int(i) for i in ids[mask].unique() if kept[mask & (ids == i)].unique().numel() > 1],
            "clipped_tokens": clipped, "zero_grad_tokens": int((mask & ~kept).sum())})
    return results


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_an_all_masked_micro_batch_gives_loss_0_and_zero_grads(name):
    result = all_masked(name, "torch")
    assert result == {"loss": 0.0, "grad_max": 0.0, "metrics": True}


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_an_all_masked_micro_batch_beside_a_normal_one_gives_the_reference_gradient(name):
    result = mixed(name, "torch")
    assert result["loss"] <= TOL and result["grad_hidden"] <= TOL and result["grad_weight"] <= TOL, result
    assert result["empty_grad_max"] == 0.0


@pytest.mark.parametrize("path", ["reference", "torch"])
def test_gspo_decides_the_clip_once_per_sequence_on_the_edge(path):
    results = gspo_edges(path)
    assert {r["side"] for r in results} == {"seq_eps_low", "seq_eps_high"}, results  # both edges met
    for result in results:
        assert result["edge_kept"] and result["split_sequences"] == [], result  # the edge counts as unclipped
        assert result["clipped_tokens"] == result["zero_grad_tokens"], result  # whole sequences, counted right
