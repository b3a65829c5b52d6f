"""Per-token log-probabilities under the rollout temperature, against a plain loop."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.logprobs import token_logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("shape", [(1, 2, 3), (3, 5, 7)])
def test_matches_a_loop(shape: tuple[int, int, int], temperature: float) -> None:
    g = torch.Generator().manual_seed(0)
    b, t, v = shape
    logits = torch.randn(b, t, v, generator=g)
    ids = torch.randint(0, v, (b, t), generator=g)
    logp, ent = token_logprobs(logits, ids, temperature, with_entropy=True)
    assert ent is not None
    for i in range(b):
        assert logp[i, 0] == 0 and ent[i, 0] == 0
        for j in range(1, t):
            z = logits[i, j - 1] / temperature
            p = torch.softmax(z, -1)
            torch.testing.assert_close(logp[i, j], torch.log(p[ids[i, j]]), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(ent[i, j], -(p * p.log()).sum(), rtol=1e-5, atol=1e-6)


def test_worked_example() -> None:
    # logits [0, ln 3] at T=1: p = [1/4, 3/4]; token 1 -> log(3/4), entropy of [1/4, 3/4].
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0]]])
    ids = torch.tensor([[0, 1]])
    logp, ent = token_logprobs(logits, ids, with_entropy=True)
    assert ent is not None
    torch.testing.assert_close(logp, torch.tensor([[0.0, math.log(0.75)]]), rtol=0, atol=1e-6)
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(ent, torch.tensor([[0.0, h]]), rtol=0, atol=1e-6)


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), 0.0)
    with pytest.raises(ValueError, match="do not align"):
        token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 3, dtype=torch.long))
