"""``train._policy.use_fused_adam``: megatron's torch Adam fallback runs torch's fused kernel, the same update up to
rounding; optimizers that are not torch's (TE's, apex's FusedAdam) are left alone."""

from __future__ import annotations

import types

import torch

from megatron_offgrpo.train._policy import use_fused_adam


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (1000, 37, 4096)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    return params


def test_megatron_s_torch_adam_switches_to_the_fused_kernel_with_the_same_update():
    fused_params, reference_params = _params(0), _params(0)
    chained = types.SimpleNamespace(chained_optimizers=[
        types.SimpleNamespace(optimizer=torch.optim.AdamW(fused_params, lr=1e-2, weight_decay=0.1)),
        types.SimpleNamespace(optimizer=object()),  # TE's / apex's FusedAdam: not a torch optimizer, left alone
    ])
    switched = use_fused_adam(chained)
    assert len(switched) == 1 and all(g["fused"] and not g["foreach"] for g in switched[0].param_groups)
    reference = torch.optim.AdamW(reference_params, lr=1e-2, weight_decay=0.1, foreach=True)
    for _ in range(3):
        switched[0].step()
        reference.step()
    for a, b in zip(fused_params, reference_params):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert use_fused_adam(types.SimpleNamespace(optimizer=torch.optim.SGD(_params(1), lr=0.1))) == []
