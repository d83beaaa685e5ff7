"""Micro-batches live on the step's device: ``build_microbatches(..., device=)`` and ``MicroBatch.to`` move every
field and keep its dtype; the schedule refuses a micro-batch left on another device. The "meta" device (no data)
stands in for a GPU on this CPU machine: a tensor that was not moved stays on "cpu" and fails the check."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_offgrpo.data import Sample
from megatron_offgrpo.train._batch import MicroBatch, build_microbatches
from megatron_offgrpo.train._packing import build_packed_microbatches
from megatron_offgrpo.train._shared_prompt import build_shared_prompt_microbatches
from megatron_offgrpo.train._step import run_schedule

DTYPES = {"tokens": torch.long, "positions": torch.long, "targets": torch.long, "loss_mask": torch.bool,
          "behavior_logp": torch.float32, "advantages": torch.float32, "fleet_logp": torch.float32,
          "seq_ids": torch.long, "padding": torch.bool, "loss_rows": torch.long}


def _samples() -> list[Sample]:
    # 2 groups of G=2; the longest sample has 3 + 3 = 6 tokens, so s = 5 positions
    lengths = [(3, 3), (2, 1), (3, 2), (1, 2)]
    return [Sample(prompt_id=f"p{i // 2}", group_id=i // 2, prompt_ids=[5 + i] * p, response_ids=[9] * r,
                   behavior_logprobs=[-0.5] * r, policy_version=0, finish_reason="stop", reward=float(i % 2))
            for i, (p, r) in enumerate(lengths)]


def _build(device=None, token_budget: int = 10) -> list[MicroBatch]:
    kwargs = {} if device is None else {"device": device}
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)  # float64 in, float32 out
    return build_microbatches(_samples(), advantages, torch.tensor([True, True, False, True]), 2,
                              token_budget=token_budget, **kwargs)


def _fields(mb: MicroBatch) -> dict[str, torch.Tensor]:
    return {f.name: getattr(mb, f.name) for f in dataclasses.fields(mb)
            if isinstance(getattr(mb, f.name), torch.Tensor)}


def test_build_microbatches_puts_every_field_on_the_device_with_its_dtype():
    on_cpu, on_meta = _build(), _build("meta")
    # token_budget 10 // 5 positions = 2 samples per micro-batch: 4 samples -> 2 micro-batches of [2, 5]
    assert len(on_cpu) == len(on_meta) == 2
    for cpu_mb, meta_mb in zip(on_cpu, on_meta):
        cpu, meta = _fields(cpu_mb), _fields(meta_mb)
        assert set(cpu) == set(meta) == set(DTYPES)  # ref_logp is set later, by the trainer
        for name, tensor in meta.items():
            assert tensor.device.type == "meta", name
            assert tensor.dtype == cpu[name].dtype == DTYPES[name], name
            assert tensor.shape == cpu[name].shape, name
            assert name == "loss_rows" or tensor.shape == (2, 5), name


def test_default_device_is_cpu_and_matches_an_explicit_cpu_build():
    for default, explicit in zip(_build(), _build(torch.device("cpu"))):
        for name, tensor in _fields(default).items():
            assert tensor.device.type == "cpu"
            assert torch.equal(tensor, getattr(explicit, name)), name


def test_to_moves_ref_logp_too_and_copies_nothing_already_there():
    mb = _build()[0]
    mb.ref_logp = torch.full(mb.targets.shape, -1.0)
    moved = mb.to("meta")
    assert {t.device.type for t in _fields(moved).values()} == {"meta"}
    assert moved.ref_logp.dtype == torch.float32 and mb.ref_logp.device.type == "cpu"  # the original is untouched
    same = mb.to("cpu")  # CPU runs stay bit-identical: the very same tensors, no copy
    assert all(getattr(same, name) is tensor for name, tensor in _fields(mb).items())
    assert _build()[0].to("meta").ref_logp is None


def test_schedule_refuses_a_micro_batch_off_the_model_device():
    mb = _build()[0]
    mb.ref_logp = torch.zeros(mb.targets.shape, device="meta")  # e.g. log-probs computed elsewhere
    with pytest.raises(ValueError,
                       match=r"micro-batch 0 has tensors \{'ref_logp': 'meta'\} off the model's device cpu"):
        run_schedule(None, [mb], lambda m, h: None, forward_only=True, device=torch.device("cpu"))


@pytest.mark.parametrize("build", [build_microbatches, build_packed_microbatches, build_shared_prompt_microbatches])
def test_padding_marks_exactly_the_positions_no_sample_fills(build):
    """Every layout marks its pads (MoE routers leave them out of the load-balancing loss and the router metrics):
    the unmarked positions are each sample's tokens less its last (the shared-prompt layout writes a group's common
    prompt once), and a micro-batch without pads carries no mask."""
    groups = [([5, 6, 7], [[9, 9, 9], [9]]), ([8, 8], [[9, 9], [9, 9, 9]])]
    samples = [Sample(f"p{g}", g, prompt, response, [-0.5] * len(response), 0, "stop", reward=float(j))
               for g, (prompt, responses) in enumerate(groups) for j, response in enumerate(responses)]
    microbatches = build(samples, torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.ones(4, dtype=torch.bool), 2,
                         token_budget=10, seq_multiple=4)
    filled = sum(int((~mb.padding).sum()) if mb.padding is not None else mb.tokens.numel() for mb in microbatches)
    # 5 + 3 + 3 + 4 positions; sharing writes each group's prompt (less its last token) once: 2 + 1 fewer
    assert filled == (15 - 3 if build is build_shared_prompt_microbatches else 15)
    for mb in microbatches:
        assert mb.padding is None or bool(mb.padding.any())
        if mb.padding is not None:
            assert not mb.loss_mask[mb.padding].any()  # no pad position enters the loss


def test_a_micro_batch_without_pads_carries_no_mask():
    full = [Sample("p0", 0, [5, 6], [9, 9], [-0.5] * 2, 0, "stop", reward=float(i)) for i in range(2)]
    (mb,) = build_microbatches(full, torch.tensor([1.0, -1.0]), torch.ones(2, dtype=torch.bool), 2)
    assert mb.padding is None and mb.tokens.shape == (2, 3)


@pytest.mark.parametrize("layout", ["padded", "packed", "shared-prompt"])
def test_loss_rows_and_target_bounds_are_found_on_the_cpu_for_every_layout(layout):
    """The step reads which rows enter the loss and the targets' range from these (no device read per
    micro-batch): they must be exactly the loss mask's rows and the range of the targets there."""
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    build = {"padded": build_microbatches, "packed": build_packed_microbatches,
             "shared-prompt": build_shared_prompt_microbatches}[layout]
    mbs = build(_samples(), advantages, torch.tensor([True, True, False, True]), 2, token_budget=10)
    assert sum(mb.loss_rows.numel() for mb in mbs) == sum(int(mb.loss_mask.sum()) for mb in mbs) > 0
    for mb in mbs:
        assert torch.equal(mb.loss_rows, mb.flat("loss_mask").nonzero().squeeze(1))
        scored = mb.flat("targets")[mb.loss_rows]
        assert mb.target_bounds == ((int(scored.min()), int(scored.max())) if scored.numel() else None)


def test_check_targets_refuses_ids_outside_the_vocabulary():
    mb = _build()[0]
    assert mb.target_bounds == (9, 9)
    mb.check_targets(10)
    with pytest.raises(ValueError, match=r"target ids of the loss span \[9, 9\] but the model's vocabulary has 9 ids"):
        mb.check_targets(9)
