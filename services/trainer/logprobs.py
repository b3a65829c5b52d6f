"""Per-token log-probabilities and entropies from logits, aligned the way trajectories are.

A trajectory's `logprobs[t]` is the behaviour policy's log-probability of token t given the
tokens before it (0 on the first token, which nothing predicts). The trainer must compare
like with like, so it computes the same quantity: logits at position t-1, divided by the
rollout `temperature` (the sampler drew from softmax(logits / T), so that is the
behaviour distribution), log-softmax, and pick token t. Without the temperature the
importance ratio would be off by a constant factor at T != 1 and PPO would clip
everything.

The logits may cover only the last positions of the sequence (`first_position`): the
trainer asks the model's head for the positions its loss reads and nothing before them,
since on a 49k-token vocabulary the head and this log-softmax over every prompt position
cost about a fifth of a training step and are thrown away.
"""

from __future__ import annotations

import torch


def first_scored_position(loss_mask: torch.Tensor) -> int:
    """The first position whose output the log-probabilities of `loss_mask` need: one
    before the first token any row trains on (position 0 when nothing is masked in).

    Token t's log-probability comes from the output at t-1, so outputs before
    (first loss token - 1) are never read; a model head asked only for the positions from
    here on (HF `logits_to_keep`) gives the same numbers at every position the loss reads.
    """
    if loss_mask.dim() != 2:
        raise ValueError(f"loss_mask must be [batch, tokens], got {tuple(loss_mask.shape)}")
    any_row = loss_mask.bool().any(dim=0)
    if not bool(any_row.any()):
        return 0
    return max(0, int(any_row.nonzero()[0, 0]) - 1)


def token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    first_position: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [B, T - first_position, V], input_ids [B, T] -> (logp [B, T], entropy [B, T]
    or None).

    `logits[:, j]` is the model's output at position `first_position + j`. Position t gets
    log p(ids[t] | ids[<t]) and the entropy of that predictive distribution for
    t > first_position, and 0 for both at t <= first_position (position 0 always: nothing
    predicts it). Computed in float32 whatever the logits' dtype. The entropy is a
    statistic: it is computed without gradient (no [B, T, V] autograd buffers for it).
    """
    if temperature <= 0:
        raise ValueError(f"gconfig.temperature must be > 0 for training, got {temperature}")
    t_total = input_ids.shape[1] if input_ids.dim() == 2 else -1
    if (
        logits.dim() != 3
        or input_ids.dim() != 2
        or not 0 <= first_position < max(t_total, 1)
        or logits.shape[:2] != (input_ids.shape[0], t_total - first_position)
    ):
        raise ValueError(
            f"logits {tuple(logits.shape)} from position {first_position} and input_ids "
            f"{tuple(input_ids.shape)} do not align"
        )
    start = first_position + 1  # the first token these logits predict
    pred = logits[:, :-1, :].float()
    if temperature != 1.0:
        pred = pred / temperature
    logz = torch.logsumexp(pred, dim=-1)
    target = input_ids[:, start:].unsqueeze(-1)
    picked = torch.gather(pred, -1, target).squeeze(-1)
    logp = torch.zeros(input_ids.shape, dtype=torch.float32, device=logits.device)
    logp[:, start:] = picked - logz
    if not with_entropy:
        return logp, None
    with torch.no_grad():
        p, z = pred.detach(), logz.detach()
        ent = z - (torch.softmax(p, dim=-1) * p).sum(-1)
    entropy = torch.zeros_like(logp, requires_grad=False)
    entropy[:, start:] = ent
    return logp, entropy
