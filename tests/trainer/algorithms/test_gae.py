"""GAE over tokens and turns, and the per-trajectory λ functions."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from services.core.plugins import RegistryError
from services.trainer.algorithms.gae import (
    discounted_reverse_cumsum,
    gae_token_level,
    gae_turn_level,
    turn_slots,
)
from services.trainer.algorithms.gae_lambda import GAE_LAMBDA_FNS, resolve_gae_lambda

from . import _reference as ref


def test_token_gae_hand_computed_eos_and_truncated() -> None:
    # positions: 0 prompt, 1..3 generated, 4 padding; reward 1 on the last generated token.
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0]])
    mask = torch.tensor([[False, True, True, True, False]])
    values = torch.tensor([[9.0, 0.5, 0.4, 0.3, 9.0]])  # 9.0 at masked positions must not leak
    # EOS: bootstrap 0, γ=0.9, λ=0.8 (γλ=0.72)
    # δ3 = 1 - 0.3 = 0.7                 A3 = 0.7
    # δ2 = 0.9*0.3 - 0.4 = -0.13         A2 = -0.13 + 0.72*0.7   = 0.374
    # δ1 = 0.9*0.4 - 0.5 = -0.14         A1 = -0.14 + 0.72*0.374 = 0.12928
    adv, ret = gae_token_level(rewards, mask, discount=0.9, gae_lambda=0.8, values=values)
    assert_close(adv, torch.tensor([[0.0, 0.12928, 0.374, 0.7, 0.0]]), rtol=0, atol=1e-6)
    # returns = A + V: 0.62928, 0.774, 1.0
    assert_close(ret, torch.tensor([[0.0, 0.62928, 0.774, 1.0, 0.0]]), rtol=0, atol=1e-6)
    # Truncated (no EOS), bootstrap V(s_end) = 0.2:
    # δ3 = 1 + 0.9*0.2 - 0.3 = 0.88      A3 = 0.88
    # A2 = -0.13 + 0.72*0.88 = 0.5036    A1 = -0.14 + 0.72*0.5036 = 0.222592
    adv, _ = gae_token_level(
        rewards, mask, discount=0.9, gae_lambda=0.8, values=values, bootstrap=torch.tensor([0.2])
    )
    assert_close(adv, torch.tensor([[0.0, 0.222592, 0.5036, 0.88, 0.0]]), rtol=0, atol=1e-6)


def test_token_gae_masked_positions_take_no_step() -> None:
    # A tool-output position (t=2) between generated tokens must be skipped, not discounted:
    # the result equals the same computation on the compacted sequence.
    rewards = torch.tensor([[0.0, 0.0, 5.0, 0.0, 1.0]])
    mask = torch.tensor([[False, True, False, True, True]])
    values = torch.tensor([[0.0, 0.5, 7.0, 0.4, 0.3]])
    adv, _ = gae_token_level(rewards, mask, discount=0.9, gae_lambda=0.8, values=values)
    compact, _ = gae_token_level(
        torch.tensor([[0.0, 0.0, 1.0]]),
        torch.ones(1, 3, dtype=torch.bool),
        discount=0.9,
        gae_lambda=0.8,
        values=torch.tensor([[0.5, 0.4, 0.3]]),
    )
    assert_close(adv[0, [1, 3, 4]], compact[0], rtol=0, atol=1e-7)
    assert adv[0, 0] == 0 and adv[0, 2] == 0


def test_gae_gamma_lambda_one_without_critic_broadcasts_the_outcome() -> None:
    # γ=λ=1, V=0, no KL: every generated token's advantage is the outcome reward.
    rewards = torch.tensor([[0.0, 0.0, 0.0, 2.5], [0.0, -1.0, 0.0, 0.0]])
    mask = torch.tensor([[False, True, True, True], [True, True, False, False]])
    adv, ret = gae_token_level(rewards, mask, discount=1.0, gae_lambda=1.0)
    expected = torch.tensor([[0.0, 2.5, 2.5, 2.5], [-1.0, -1.0, 0.0, 0.0]])
    assert_close(adv, expected, rtol=0, atol=0)
    assert_close(ret, expected, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (8, 33), (5, 64), (3, 150), (2, 700)])
def test_token_gae_matches_plain_loop(shape: tuple[int, int], gen: torch.Generator) -> None:
    b, t = shape
    rewards = torch.randn(b, t, generator=gen)
    values = torch.randn(b, t, generator=gen)
    mask = torch.rand(b, t, generator=gen) < 0.7
    lam = torch.rand(b, generator=gen)
    boot = torch.randn(b, generator=gen)
    adv, ret = gae_token_level(
        rewards, mask, discount=0.95, gae_lambda=lam, values=values, bootstrap=boot
    )
    for i in range(b):
        a_ref, g_ref = ref.gae_sequence(
            rewards[i].tolist(),
            values[i].tolist(),
            mask[i].tolist(),
            discount=0.95,
            lam=float(lam[i]),
            bootstrap=float(boot[i]),
        )
        assert_close(adv[i], torch.tensor(a_ref), rtol=1e-5, atol=1e-5)
        assert_close(ret[i], torch.tensor(g_ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("factor", [0.0, 0.3, 0.999, 1.0])
def test_discounted_reverse_cumsum_long_rows(factor: float, gen: torch.Generator) -> None:
    # Longer than many chunks, with factors that would underflow a closed-form power sum.
    x = torch.randn(2, 1000, generator=gen, dtype=torch.float64)
    got = discounted_reverse_cumsum(x, torch.full((2,), factor, dtype=torch.float64))
    expected = torch.empty_like(x)
    acc = torch.zeros(2, dtype=torch.float64)
    for t in range(999, -1, -1):
        acc = x[:, t] + factor * acc
        expected[:, t] = acc
    assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_turn_gae_hand_computed() -> None:
    # Two turns of two tokens; values at the first token of each turn are 0.5 and 0.3.
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    turn_ids = torch.tensor([[0, 0, 1, 1]])
    values = torch.tensor([[0.5, 0.9, 0.3, 0.7]])
    # u1: δ = 1 - 0.3 = 0.7, A1 = 0.7; u0: δ = 0.9*0.3 - 0.5 = -0.23, A0 = -0.23 + 0.72*0.7 = 0.274
    adv, ret = gae_turn_level(rewards, mask, turn_ids, discount=0.9, gae_lambda=0.8, values=values)
    assert_close(adv, torch.tensor([[0.274, 0.274, 0.7, 0.7]]), rtol=0, atol=1e-6)
    # G = A_u + V_u: 0.774 and 1.0
    assert_close(ret, torch.tensor([[0.774, 0.774, 1.0, 1.0]]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("shape", [(1, 5), (4, 17), (6, 40)])
def test_turn_gae_with_one_token_per_turn_equals_token_gae(
    shape: tuple[int, int], gen: torch.Generator
) -> None:
    b, t = shape
    rewards = torch.randn(b, t, generator=gen)
    values = torch.randn(b, t, generator=gen)
    mask = torch.rand(b, t, generator=gen) < 0.8
    turn_ids = torch.where(mask, torch.arange(t).expand(b, t), -1)
    boot = torch.randn(b, generator=gen)
    kwargs = dict(discount=0.97, gae_lambda=0.9, values=values, bootstrap=boot)
    a_tok, g_tok = gae_token_level(rewards, mask, **kwargs)
    a_turn, g_turn = gae_turn_level(rewards, mask, turn_ids, **kwargs)
    assert_close(a_turn, a_tok, rtol=1e-6, atol=1e-6)
    assert_close(g_turn, g_tok, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [(2, 9), (5, 30)])
def test_turn_gae_matches_plain_loop(shape: tuple[int, int], gen: torch.Generator) -> None:
    b, t = shape
    rewards = torch.randn(b, t, generator=gen)
    values = torch.randn(b, t, generator=gen)
    mask = torch.rand(b, t, generator=gen) < 0.75
    # Turns of random lengths with gaps in the numbering (gaps take no step).
    turn = torch.cumsum((torch.rand(b, t, generator=gen) < 0.3).long(), dim=1) * 2
    turn_ids = torch.where(mask, turn, -1)
    adv, ret = gae_turn_level(rewards, mask, turn_ids, discount=0.9, gae_lambda=0.7, values=values)
    for i in range(b):
        a_ref, g_ref = ref.turn_gae_sequence(
            rewards[i].tolist(),
            values[i].tolist(),
            mask[i].tolist(),
            turn_ids[i].tolist(),
            discount=0.9,
            lam=0.7,
            bootstrap=0.0,
        )
        assert_close(adv[i], torch.tensor(a_ref), rtol=1e-5, atol=1e-5)
        assert_close(ret[i], torch.tensor(g_ref), rtol=1e-5, atol=1e-5)


def test_turn_slots_rejects_bad_turn_ids() -> None:
    mask = torch.tensor([[True, True, True]])
    with pytest.raises(ValueError, match="non-decreasing"):
        turn_slots(mask, torch.tensor([[1, 0, 1]]))
    with pytest.raises(ValueError, match=">= 0 on every generated"):
        turn_slots(mask, torch.tensor([[0, -1, 1]]))
    slot, new_turn, counts = turn_slots(
        torch.tensor([[False, True, True, False, True]]), torch.tensor([[-1, 3, 3, -1, 7]])
    )
    assert counts.tolist() == [2]
    assert new_turn.tolist() == [[False, True, False, False, True]]
    assert slot[0, [1, 2, 4]].tolist() == [0, 0, 1]


def _ctx(lengths: list[int]) -> dict[str, torch.Tensor]:
    t = torch.tensor(lengths)
    return {"effective_token_lengths": t, "turn_counts": t * 0, "timestep_lengths": t}


def test_lambda_functions_hand_computed() -> None:
    ctx = _ctx([100, 10, 0])
    # vapo α=0.05: L=100 → 1 - 1/(0.05*100) = 0.8; L=10 → 1 - 1/0.5 = -1 → clamped 0; L=0 → 0
    lam = resolve_gae_lambda("vapo_length_adaptive", ctx, {"alpha": 0.05})
    assert_close(lam, torch.tensor([0.8, 0.0, 0.0]), rtol=0, atol=1e-6)
    # relative_position q=0.5: L=3 → 0.5^(1/2) = 0.70710678; L=1 → 1; L=0 → 0
    lam = resolve_gae_lambda("relative_position", _ctx([3, 1, 0]), {"q": 0.5})
    assert_close(lam, torch.tensor([0.70710678, 1.0, 0.0]), rtol=0, atol=1e-6)
    lam = resolve_gae_lambda("constant", ctx, {"value": 0.95})
    assert_close(lam, torch.full((3,), 0.95), rtol=0, atol=0)
    # AReaL's dotted path resolves to the same built-in.
    lam2 = resolve_gae_lambda(
        "areal.trainer.ppo.lambda_fn.relative_position_gae_lambda", _ctx([3]), {"q": 0.5}
    )
    assert_close(lam2, torch.tensor([0.70710678]), rtol=0, atol=1e-6)


def _bad_lambda(context, **kwargs):  # type: ignore[no-untyped-def]
    return torch.full(context["timestep_lengths"].shape, 1.5)


def _nan_lambda(context, **kwargs):  # type: ignore[no-untyped-def]
    return torch.full(context["timestep_lengths"].shape, float("nan"))


def test_lambda_by_dotted_path_and_validation() -> None:
    here = __name__
    with pytest.raises(ValueError, match=r"lambda=1.5.*\[0, 1\]"):
        resolve_gae_lambda(f"{here}._bad_lambda", _ctx([2]))
    with pytest.raises(ValueError, match="non-finite"):
        resolve_gae_lambda(f"{here}._nan_lambda", _ctx([2]))
    with pytest.raises(RegistryError, match="valid: constant, relative_position"):
        resolve_gae_lambda("no_such_lambda", _ctx([2]))
    with pytest.raises(ValueError, match="alpha must be > 0"):
        resolve_gae_lambda("vapo_length_adaptive", _ctx([2]), {"alpha": 0})
    assert set(GAE_LAMBDA_FNS.names()) >= {"constant", "vapo_length_adaptive", "relative_position"}
