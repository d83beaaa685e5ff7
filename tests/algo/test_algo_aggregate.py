"""aggregate (three modes, global counts, all-masked) and the packed-layout helpers."""

import pytest
import torch

from megatron_offgrpo.algo import ObjectiveParams, broadcast_to_tokens
from megatron_offgrpo.algo._aggregate import aggregate
from megatron_offgrpo.algo._packing import resolve_seq_ids

F64 = torch.float64

# losses [1, 2, 3, 4, 6]; token 2 masked (its 3 never counts); sequences [0, 0, 0, 0, 1]
LOSS = [1.0, 2.0, 3.0, 4.0, 6.0]
MASK = torch.tensor([True, True, False, True, True])
SEQ = torch.tensor([0, 0, 0, 0, 1])


def run(params, **kwargs):
    loss = torch.tensor(LOSS, dtype=F64, requires_grad=True)
    out = aggregate(loss, MASK, params, **kwargs)
    out.backward()
    return out.item(), loss.grad.tolist()


def test_token_mean_by_hand():
    value, grad = run(ObjectiveParams())
    assert value == pytest.approx((1 + 2 + 4 + 6) / 4)  # 13 / 4 valid tokens
    assert grad == [0.25, 0.25, 0.0, 0.25, 0.25]


def test_token_mean_global_count():
    value, grad = run(ObjectiveParams(), global_token_count=8.0)  # this rank's share of an 8-token global batch
    assert value == pytest.approx(13 / 8) and grad == [0.125, 0.125, 0.0, 0.125, 0.125]
    value_t, _ = run(ObjectiveParams(), global_token_count=torch.tensor(8.0))
    assert value_t == pytest.approx(13 / 8)


def test_seq_mean_token_mean_by_hand():
    # seq 0 valid tokens [1, 2, 4] -> 7/3; seq 1 [6] -> 6; mean over 2 sequences = (7/3 + 6) / 2 = 25/6
    params = ObjectiveParams(aggregation="seq_mean_token_mean")
    value, grad = run(params, seq_ids=SEQ)
    assert value == pytest.approx(25 / 6)
    assert grad == pytest.approx([1 / 6, 1 / 6, 0.0, 1 / 6, 1 / 2])  # 1 / (n_s * S)
    assert run(params, cu_seqlens=torch.tensor([0, 4, 5]))[0] == pytest.approx(25 / 6)
    value_g, _ = run(params, seq_ids=SEQ, global_seq_count=4)
    assert value_g == pytest.approx((7 / 3 + 6) / 4)


def test_seq_mean_skips_sequences_without_valid_tokens():
    # sequence 1 = [token 2] is fully masked: it does not count as a sequence
    params = ObjectiveParams(aggregation="seq_mean_token_mean")
    value, _ = run(params, seq_ids=torch.tensor([0, 0, 1, 2, 2]))
    assert value == pytest.approx((1.5 + 5.0) / 2)


def test_token_sum_norm_by_hand():
    value, grad = run(ObjectiveParams(aggregation="token_sum_norm", aggregation_constant=10.0))
    assert value == pytest.approx(1.3) and grad == pytest.approx([0.1, 0.1, 0.0, 0.1, 0.1])  # 13 / 10


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "token_sum_norm"])
def test_all_masked_batch_gives_zero_not_nan(aggregation):
    params = ObjectiveParams(aggregation=aggregation, aggregation_constant=4.0)
    loss = torch.tensor([5.0, float("nan")], requires_grad=True)
    out = aggregate(loss, torch.zeros(2, dtype=torch.bool), params, seq_ids=torch.tensor([0, 1]), global_seq_count=0)
    out.backward()
    assert out.item() == 0.0 and loss.grad.tolist() == [0.0, 0.0]


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"global_token_count": -1.0}, "global_token_count=-1.0 must be a finite count"),
        ({"global_token_count": float("nan")}, "global_token_count=nan"),
        ({"global_token_count": torch.ones(2)}, "global_token_count has shape"),
    ],
)
def test_bad_counts(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        aggregate(torch.zeros(5), MASK, ObjectiveParams(), **kwargs)


def test_bad_layout_and_shapes():
    params = ObjectiveParams(aggregation="seq_mean_token_mean")
    with pytest.raises(ValueError, match="pass exactly one of seq_ids or cu_seqlens"):
        aggregate(torch.zeros(5), MASK, params)
    with pytest.raises(ValueError, match="pass exactly one"):
        aggregate(torch.zeros(5), MASK, params, seq_ids=SEQ, cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="per_token_loss has 4 entries"):
        aggregate(torch.zeros(4), MASK, ObjectiveParams())


def test_resolve_seq_ids_and_broadcast():
    ids, num = resolve_seq_ids(5, cu_seqlens=torch.tensor([0, 2, 2, 5]))  # middle sequence is empty
    assert ids.tolist() == [0, 0, 2, 2, 2] and num == 3
    per_sample = torch.tensor([0.5, -1.0, 2.0])
    assert broadcast_to_tokens(per_sample, cu_seqlens=torch.tensor([0, 2, 2, 5])).tolist() == [0.5, 0.5, 2, 2, 2]
    valid = torch.tensor([True, False])
    assert broadcast_to_tokens(valid, seq_ids=torch.tensor([1, 1, 0])).tolist() == [False, False, True]
    assert resolve_seq_ids(0, seq_ids=torch.zeros(0, dtype=torch.long))[1] == 0


@pytest.mark.parametrize(
    "call, needle",
    [
        (lambda: resolve_seq_ids(3, cu_seqlens=torch.tensor([0, 2, 1, 3])), "never decrease"),
        (lambda: resolve_seq_ids(3, cu_seqlens=torch.tensor([1, 3])), "start at 0"),
        (lambda: resolve_seq_ids(3, cu_seqlens=torch.tensor([0.0, 3.0])), "integer tensor"),
        (lambda: resolve_seq_ids(2, seq_ids=torch.tensor([0, -1])), "negative value -1"),
        (lambda: resolve_seq_ids(2, seq_ids=torch.tensor([0.0, 1.0])), "integer tensor"),
        (lambda: resolve_seq_ids(3, seq_ids=torch.tensor([0, 1])), "seq_ids has 2 entries"),
        (lambda: broadcast_to_tokens(torch.zeros(1), seq_ids=torch.tensor([0, 1])), "S=2 sequences"),
        (lambda: broadcast_to_tokens(torch.zeros(2, 2), seq_ids=torch.tensor([0, 1])), "per_sample has shape"),
    ],
)
def test_bad_layouts(call, needle):
    with pytest.raises(ValueError, match=needle):
        call()
