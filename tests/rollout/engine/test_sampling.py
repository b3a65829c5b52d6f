"""Per-row sampling: filters, reported log-probabilities, seeds."""

from __future__ import annotations

import math

import pytest
import torch

from services.rollout.engine.sampling import RowSampling, draw, filter_top_k_top_p, sample_next


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    # mass strictly before each token: 0, 0.5, 0.8 -> with p = 0.6 tokens 0 and 1 stay
    out = filter_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.6]))
    assert torch.isfinite(out[0]).tolist() == [True, True, False]
    # p = 0.5: mass before token 1 is 0.5, not < 0.5 -> only token 0
    out = filter_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.5]))
    assert torch.isfinite(out[0]).tolist() == [True, False, False]


def test_top_k_per_row_and_unsorted_positions() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0], [5.0, 1.0, 4.0, 3.0]])
    out = filter_top_k_top_p(logits, torch.tensor([2, 0]), torch.tensor([1.0, 1.0]))
    assert torch.isfinite(out).tolist() == [[False, True, True, False], [True, True, True, True]]


def test_logprob_is_log_softmax_at_the_sampling_temperature() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 5.0]])
    rows = [RowSampling(temperature=0.5), RowSampling(greedy=True, temperature=0.5)]
    tokens, lps = sample_next(logits, rows, torch.Generator().manual_seed(0))
    expected0 = torch.log_softmax(logits[0] / 0.5, -1)[tokens[0]]
    # greedy rows report the temperature-1 log-probability of the arg-max:
    # log(e^5 / (2 + e^5)) = 5 - log(2 + e^5)
    assert tokens[1].item() == 2
    torch.testing.assert_close(lps[0], expected0, rtol=0, atol=1e-6)
    torch.testing.assert_close(lps[1].item(), 5 - math.log(2 + math.exp(5)), rtol=0, atol=1e-6)


def test_filters_do_not_change_the_reported_logprob() -> None:
    logits = torch.tensor([[1.0, 0.5, 0.2, 0.1]])
    tokens, lps = sample_next(logits, [RowSampling(top_k=1)], torch.Generator().manual_seed(1))
    assert tokens.item() == 0  # top-1 leaves only the arg-max
    torch.testing.assert_close(lps[0], torch.log_softmax(logits[0], -1)[0], rtol=0, atol=1e-6)


def test_banned_ids_are_never_drawn() -> None:
    logits = torch.zeros(64, 3)
    logits[:, 1] = 10.0  # token 1 would win almost always
    rows = [RowSampling(banned_ids=(1,)) for _ in range(64)]
    tokens, _ = sample_next(logits, rows, torch.Generator().manual_seed(0))
    assert 1 not in tokens.tolist()


def test_seeded_rows_do_not_depend_on_their_neighbours() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 10, generator=g)

    def draw(batch_logits: torch.Tensor, n_unseeded: int) -> int:
        rows = [RowSampling(generator=torch.Generator().manual_seed(42))]
        rows += [RowSampling() for _ in range(n_unseeded)]
        tokens, _ = sample_next(batch_logits, rows, torch.Generator().manual_seed(n_unseeded))
        return int(tokens[0])

    alone = draw(logits[:1], 0)
    assert draw(logits, 2) == alone


def test_frequency_penalty_lowers_repeated_tokens() -> None:
    logits = torch.tensor([[1.0, 1.0]])
    # token 0 seen 3 times, penalty 2 -> logit 1 - 6 = -5: greedy must pick token 1
    tokens, lps = sample_next(
        logits, [RowSampling(greedy=True, frequency_penalty=2.0, history=[0, 0, 0])], None
    )
    assert tokens.item() == 1
    torch.testing.assert_close(lps[0].item(), math.log(0.5), rtol=0, atol=1e-6)


@pytest.mark.parametrize("shape", [(1, 3), (32, 24), (5, 1000)])
def test_draw_is_multinomial_draw_for_draw(shape: tuple[int, int]) -> None:
    """Same tokens as torch.multinomial(probs, 1) from the same generator state, and the
    generator left in the same state (checked by the next draws agreeing too)."""
    probs = torch.softmax(torch.randn(shape, generator=torch.Generator().manual_seed(7)), -1)
    probs[0, 0] = 0.0  # a zero-probability token is never drawn
    for seed in range(20):
        ours, ref = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        for _ in range(3):
            expected = torch.multinomial(probs, 1, generator=ref).squeeze(-1)
            assert torch.equal(draw(probs, ours), expected)
