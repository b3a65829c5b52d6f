"""The one place where per-token losses become the scalar that is back-propagated.

Modes (`actor.loss_agg_mode`), with l_t the per-token loss and m_t the loss mask:

* `token-mean` (AReaL's default): Σ_t m_t l_t / N, N = valid tokens of the whole
  minibatch.
* `seq-mean-token-mean`: Σ_i (Σ_t m_t l_t / n_i) / S, n_i = valid tokens of sequence i,
  S = sequences (with at least one valid token) of the whole minibatch.
* `seq-mean-token-sum-norm` (Dr.GRPO): Σ_i (Σ_t m_t l_t / C) / S, C a constant
  (`loss_agg_norm`, by default `max_new_tokens`), so no sequence's tokens are
  up- or down-weighted by its length.

Why the result does not depend on data-parallel size or micro-batching: the denominator
(N or S, and C) is a property of the whole minibatch, passed in as `normalizer` by the
trainer (one all-reduce of the counts before the first micro-batch), never the count of
the micro-batch at hand. Each micro-batch on each rank then contributes its own partial
sum Σ_{its tokens} m_t l_t / N, and the sums over micro-batches (gradient accumulation)
and over ranks (gradient all-reduce) add up to exactly the full-minibatch value, whatever
the split. A per-micro-batch mean would instead weigh tokens by 1/(tokens of their
micro-batch) and change with the split. Under FSDP/DDP, which *average* gradients over
the W ranks, pass `normalizer = N / W` (or multiply the loss by W) to keep the sum.
`seq-mean-token-mean` needs whole sequences in one micro-batch (the trainer never splits a
sequence). Without `normalizer` the local count is used: correct only when one call sees
the whole minibatch.

Tokens dropped by rejection sampling still count in N: the denominator is taken from the
loss mask before it, so dropping a token removes its contribution instead of inflating
everybody else's (AReaL's `ppo_actor_loss_fn`). M2PO's mask, as in AReaL, is the loss
mask the loss sees: `ppo_actor_loss` passes it as `denominator_mask` and scales a given
`normalizer` by the call's N_after / N_before M2PO.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from services.core.plugins import Registry

from .layout import layout_of, seq_sum


class Aggregator(Protocol):
    """`(per_token_loss, mask, denominator_mask, cu_seqlens, normalizer, constant) -> loss`."""

    def __call__(
        self,
        per_token_loss: Tensor,
        mask: Tensor,
        denominator_mask: Tensor,
        cu_seqlens: Tensor | None,
        normalizer: float | Tensor | None,
        constant: float | None,
    ) -> Tensor: ...


AGGREGATORS: Registry[Aggregator] = Registry("loss aggregation mode", validate=callable)


def _denominator(normalizer: float | Tensor | None, local: Tensor) -> Tensor:
    if normalizer is None:
        return local.to(torch.float32).clamp(min=1)
    n = torch.as_tensor(normalizer, dtype=torch.float32, device=local.device)
    if not bool(n > 0):
        raise ValueError(f"normalizer must be > 0, got {float(n)}")
    return n


@AGGREGATORS.register("token-mean")
def _token_mean(per_token_loss, mask, denominator_mask, cu_seqlens, normalizer, constant):  # type: ignore[no-untyped-def]
    total = torch.where(mask, per_token_loss, 0.0).sum()
    return total / _denominator(normalizer, denominator_mask.sum())


@AGGREGATORS.register("seq-mean-token-mean")
def _seq_mean_token_mean(per_token_loss, mask, denominator_mask, cu_seqlens, normalizer, constant):  # type: ignore[no-untyped-def]
    layout = layout_of(mask, cu_seqlens)
    per_seq = seq_sum(torch.where(mask, per_token_loss, 0.0), layout)
    n_tok = seq_sum(denominator_mask.to(per_token_loss.dtype), layout)
    seq_loss = per_seq / n_tok.clamp(min=1)
    return seq_loss.sum() / _denominator(normalizer, (n_tok > 0).sum())


@AGGREGATORS.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(
    per_token_loss, mask, denominator_mask, cu_seqlens, normalizer, constant
):  # type: ignore[no-untyped-def]
    if constant is None or not constant > 0:
        raise ValueError(
            "loss_agg_mode='seq-mean-token-sum-norm' needs a positive constant "
            f"(loss_agg_norm or max_new_tokens), got {constant!r}"
        )
    layout = layout_of(mask, cu_seqlens)
    total = torch.where(mask, per_token_loss, 0.0).sum() / constant
    n_tok = seq_sum(denominator_mask.to(torch.float32), layout)
    return total / _denominator(normalizer, (n_tok > 0).sum())


def aggregate_loss(
    per_token_loss: Tensor,
    loss_mask: Tensor,
    mode: str = "token-mean",
    *,
    denominator_mask: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    normalizer: float | Tensor | None = None,
    constant: float | None = None,
) -> Tensor:
    """Aggregate per-token losses into one scalar (see the module docstring).

    `loss_mask` selects the tokens whose losses are summed; `denominator_mask` (default:
    `loss_mask`) is what the local token/sequence counts come from when `normalizer` is
    None — pass the mask from before rejection sampling (after M2PO). `normalizer` is the
    minibatch-wide count (tokens for `token-mean`, sequences for the two seq modes).
    """
    if per_token_loss.shape != loss_mask.shape:
        raise ValueError(
            f"per_token_loss has shape {tuple(per_token_loss.shape)} but loss_mask has "
            f"{tuple(loss_mask.shape)}"
        )
    mask = loss_mask.to(torch.bool)
    den = mask if denominator_mask is None else denominator_mask.to(torch.bool)
    fn = AGGREGATORS.get(mode)
    return fn(per_token_loss, mask, den, cu_seqlens, normalizer, constant)
