"""Per-token log-probabilities and entropies from logits, aligned the way trajectories are.

A trajectory's `logprobs[t]` is the behaviour policy's log-probability of token t given the
tokens before it (0 on the first token, which nothing predicts). The trainer must compare
like with like, so it computes the same quantity: logits at position t-1, divided by the
rollout `temperature` (the sampler drew from softmax(logits / T), so that is the
behaviour distribution), log-softmax, and pick token t. Without the temperature the
importance ratio would be off by a constant factor at T != 1 and PPO would clip
everything.
"""

from __future__ import annotations

import torch


def token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [B, T, V], input_ids [B, T] -> (logp [B, T], entropy [B, T] or None).

    Position 0 gets 0 for both; position t>0 holds log p(ids[t] | ids[<t]) and the entropy
    of that predictive distribution. Computed in float32 whatever the logits' dtype.
    """
    if temperature <= 0:
        raise ValueError(f"gconfig.temperature must be > 0 for training, got {temperature}")
    if logits.dim() != 3 or input_ids.shape != logits.shape[:2]:
        raise ValueError(
            f"logits {tuple(logits.shape)} and input_ids {tuple(input_ids.shape)} do not align"
        )
    pred = logits[:, :-1, :].float()
    if temperature != 1.0:
        pred = pred / temperature
    logz = torch.logsumexp(pred, dim=-1)
    target = input_ids[:, 1:].unsqueeze(-1)
    picked = torch.gather(pred, -1, target).squeeze(-1)
    logp = torch.zeros(input_ids.shape, dtype=torch.float32, device=logits.device)
    logp[:, 1:] = picked - logz
    if not with_entropy:
        return logp, None
    probs = torch.softmax(pred, dim=-1)
    ent = logz - (probs * pred).sum(-1)
    entropy = torch.zeros_like(logp)
    entropy[:, 1:] = ent
    return logp, entropy
