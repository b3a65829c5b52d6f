"""Per-token log-probabilities under the rollout temperature, against a plain loop."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.logprobs import first_scored_position, token_logprobs


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


@pytest.mark.parametrize("first", [1, 3])
def test_logits_of_a_suffix_give_the_same_logprobs(first: int) -> None:
    # Logits of positions first.. only (what the head returns with HF `logits_to_keep`):
    # every token after `first` gets the full computation's numbers, the rest 0.
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 6, 11, generator=g)
    ids = torch.randint(0, 11, (2, 6), generator=g)
    full, full_ent = token_logprobs(logits, ids, 0.7, with_entropy=True)
    part, part_ent = token_logprobs(
        logits[:, first:], ids, 0.7, with_entropy=True, first_position=first
    )
    assert full_ent is not None and part_ent is not None
    torch.testing.assert_close(part[:, first + 1 :], full[:, first + 1 :], rtol=0, atol=0)
    torch.testing.assert_close(part_ent[:, first + 1 :], full_ent[:, first + 1 :], rtol=0, atol=0)
    assert not part[:, : first + 1].any() and not part_ent[:, : first + 1].any()
    with pytest.raises(ValueError, match="do not align"):
        token_logprobs(logits[:, first:], ids, first_position=first + 1)


def test_first_scored_position() -> None:
    # Row 0 trains on tokens 3-4, row 1 on 5: token 3 is predicted at position 2.
    mask = torch.tensor([[0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]])
    assert first_scored_position(mask) == 2
    assert first_scored_position(torch.tensor([[1, 1, 0]])) == 0
    assert first_scored_position(torch.zeros(2, 4)) == 0


def test_entropy_carries_no_gradient() -> None:
    logits = torch.randn(1, 4, 5, requires_grad=True)
    logp, ent = token_logprobs(logits, torch.tensor([[0, 1, 2, 3]]), with_entropy=True)
    assert ent is not None and not ent.requires_grad and logp.requires_grad
