"""On-policy distillation's per-token advantage: the negative reverse KL to a teacher, token by token.

For a token ``x_t`` the student sampled, ``d_t = log pi_teacher(x_t) - log pi_student(x_t)`` is minus the one-sample
estimate of ``KL(pi_student || pi_teacher)`` at that position: a policy-gradient step with advantage ``d_t`` lowers
the reverse KL (Agarwal et al. 2024, "On-Policy Distillation of Language Models"; Qwen3's small models; Thinking
Machines' "On-Policy Distillation", 2025). ``log pi_student`` is the behavior log-prob, the distribution the token
was sampled from (the off-policy ratio then corrects for the lag, as for the reward's advantage). With a discount
``gamma`` > 0 a token is also credited with the later tokens' terms: ``A_t = sum_{k >= t} gamma^(k-t) d_k`` over the
sequence's trained tokens (``gamma = 0``: each token its own term, the common choice).
"""

from __future__ import annotations

import torch


def distill_advantages(teacher_logp: torch.Tensor, behavior_logp: torch.Tensor, loss_mask: torch.Tensor,
                       seq_ids: torch.Tensor | None = None, discount: float = 0.0) -> torch.Tensor:
    """Per-token advantages ``A_t`` (0 on masked tokens). Detached.

    Args:
        teacher_logp: [N] the teacher's log-prob of each token. behavior_logp: [N] the student's (sampling) log-prob.
        loss_mask: [N] bool, True = a trained token (the terms and the discounted sums run over these only).
        seq_ids: [N] the sequence of each token (packed rows), in order within a sequence; None: one sequence.
        discount: gamma in [0, 1].

    Returns:
        [N] ``A_t``, in float64 for the discounted sums, cast back to ``teacher_logp``'s dtype.
    """
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"distillation discount={discount}: must be in [0, 1]")
    zero = torch.zeros((), dtype=torch.float64, device=teacher_logp.device)
    d = torch.where(loss_mask, teacher_logp.double() - behavior_logp.double(), zero)
    if discount == 0.0 or d.numel() == 0:
        return d.to(teacher_logp.dtype)
    # A_t = d_t + gamma * A_{t'}, t' the sequence's next trained token: one backward sweep per sequence over its
    # trained positions, on host copies (a scalar loop; it runs once a step before the step, never inside it)
    ids = [0] * d.shape[0] if seq_ids is None else seq_ids.cpu().tolist()
    values, trained = d.cpu().tolist(), loss_mask.cpu().tolist()
    out, running = [0.0] * len(values), {}
    for t in range(len(values) - 1, -1, -1):
        if trained[t]:
            seq = ids[t]
            running[seq] = values[t] + discount * running.get(seq, 0.0)
            out[t] = running[seq]
    out = torch.tensor(out, dtype=torch.float64, device=d.device)
    return out.to(teacher_logp.dtype)


def reverse_kl_sums(teacher_logp: torch.Tensor, behavior_logp: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[2] float64: the sum over trained tokens of ``log pi_student - log pi_teacher`` and their count, the per-token
    reverse-KL estimate's numerator and denominator (the ``teacher_kl`` metric: summed over ranks, then divided)."""
    diff = torch.where(loss_mask, behavior_logp.double() - teacher_logp.double(), 0.0)
    return torch.stack([diff.sum(), loss_mask.sum().double()])
