"""Loss aggregation: modes by hand, and independence of micro-batch split / DP size."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from services.core.plugins import RegistryError
from services.trainer.algorithms.aggregation import aggregate_loss

from ._views import ppo_loss_with

LOSS = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
MASK = torch.tensor([[True, True, True, False], [True, False, False, False]])


def test_modes_hand_computed() -> None:
    # token-mean: (1+2+3+4)/4 = 2.5
    assert_close(aggregate_loss(LOSS, MASK, "token-mean"), torch.tensor(2.5), rtol=0, atol=0)
    # seq-mean-token-mean: (6/3 + 4/1)/2 = 3
    assert_close(
        aggregate_loss(LOSS, MASK, "seq-mean-token-mean"), torch.tensor(3.0), rtol=0, atol=0
    )
    # seq-mean-token-sum-norm, C = 8: (6/8 + 4/8)/2 = 0.625
    assert_close(
        aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", constant=8.0),
        torch.tensor(0.625),
        rtol=0,
        atol=0,
    )
    # an explicit normalizer replaces the local count: 10 / 8 = 1.25
    assert_close(aggregate_loss(LOSS, MASK, normalizer=8), torch.tensor(1.25), rtol=0, atol=0)
    with pytest.raises(
        RegistryError, match="valid: seq-mean-token-mean, seq-mean-token-sum-norm, token-mean"
    ):
        aggregate_loss(LOSS, MASK, "sum")
    with pytest.raises(ValueError, match="needs a positive constant"):
        aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("splits", [[6], [1, 5], [2, 2, 2], [3, 1, 2]])
def test_micro_batch_split_and_ranks_do_not_change_loss_or_gradient(
    mode: str, splits: list[int], gen: torch.Generator
) -> None:
    # A minibatch of 6 sequences split into micro-batches (or spread over ranks) must give
    # the same summed loss and gradient when each part uses the minibatch-wide normalizer.
    b, t = 6, 7
    prox = torch.randn(b, t, generator=gen) - 1
    logp0 = prox + 0.3 * torch.randn(b, t, generator=gen)
    adv = torch.randn(b, t, generator=gen)
    mask = torch.rand(b, t, generator=gen) < 0.7
    mask[:, 0] = True
    norm = float(mask.sum()) if mode == "token-mean" else float(b)
    kw = dict(loss_agg_mode=mode, loss_agg_norm=16.0, eps_clip=0.2)

    whole_lp = logp0.clone().requires_grad_(True)
    whole, _ = ppo_loss_with(whole_lp, prox, adv, mask, normalizer=norm, **kw)
    whole.backward()

    parts_lp = logp0.clone().requires_grad_(True)
    total = torch.zeros(())
    start = 0
    for n in splits:
        rows = slice(start, start + n)
        part, _ = ppo_loss_with(
            parts_lp[rows], prox[rows], adv[rows], mask[rows], normalizer=norm, **kw
        )
        part.backward()  # gradient accumulation, as in the trainer
        total = total + part.detach()
        start += n
    assert_close(total, whole.detach(), rtol=1e-6, atol=1e-6)
    assert_close(parts_lp.grad, whole_lp.grad, rtol=1e-6, atol=1e-7)


def test_local_normaliser_would_depend_on_the_split() -> None:
    # Why the normaliser must be global: per-micro-batch token means weigh tokens differently.
    # micro-batch A = row 0 (3 tokens, sum 6), B = row 1 (1 token, sum 4)
    a = aggregate_loss(LOSS[:1], MASK[:1])  # 6/3 = 2
    b = aggregate_loss(LOSS[1:], MASK[1:])  # 4/1 = 4
    assert (a + b) / 2 == 3.0  # averaged means: 3.0, not the token mean 2.5
    whole = aggregate_loss(LOSS, MASK)
    assert whole == 2.5


def test_dropped_tokens_keep_their_place_in_the_denominator() -> None:
    # rejection/M2PO drops a token: its loss leaves the numerator, the count stays
    kept = torch.tensor([[True, False, True, False], [True, False, False, False]])
    out = aggregate_loss(LOSS, kept, denominator_mask=MASK)
    # (1 + 3 + 4)/4 = 2
    assert_close(out, torch.tensor(2.0), rtol=0, atol=0)
