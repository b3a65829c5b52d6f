"""Actor surrogates (clip, dual clip, clip-higher, GSPO, decoupled, SAPO, CISPO) and the
critic loss: worked values, invariants, autograd gradients, masking and layouts."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from services.common.config import RejectionSamplingConfig
from services.core.plugins import RegistryError
from services.trainer.algorithms.layout import padded_to_packed
from services.trainer.algorithms.stats import (
    ACTOR_TOKEN_STATS,
    CRITIC_TOKEN_STATS,
    check_stat_names,
    summarize_token_stats,
)
from services.trainer.algorithms.surrogates import SURROGATES

from . import _reference as ref
from ._views import critic_loss_with, loss_view, ppo_loss_with


def _avg(stats: dict[str, torch.Tensor], name: str, critic: bool = False) -> torch.Tensor:
    """`<name>/avg` as the trainer reports it for a step that is this one call."""
    table = CRITIC_TOKEN_STATS if critic else ACTOR_TOKEN_STATS
    return summarize_token_stats(stats, table)[f"{name}/avg"]


def _reported(stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Scalars plus the summaries of the per-token statistics."""
    out = {k: v for k, v in stats.items() if v.dim() == 0}
    out.update(summarize_token_stats(stats, ACTOR_TOKEN_STATS))
    return out


def _one_row(ratios: list[float], advs: list[float]) -> tuple[torch.Tensor, ...]:
    prox = torch.full((1, len(ratios)), -1.0)
    logp = (prox + torch.log(torch.tensor([ratios]))).requires_grad_(True)
    adv = torch.tensor([advs])
    mask = torch.ones(1, len(ratios), dtype=torch.bool)
    return logp, prox, adv, mask


def test_clip_surrogate_hand_computed() -> None:
    # ratio, A: (1.5, +1) clip binds -> -1.2 ; (1.5, -1) -> +1.5 ; (0.5, +1) -> -0.5 ;
    # (0.5, -1) clip binds -> +0.8. token-mean = (-1.2 + 1.5 - 0.5 + 0.8)/4 = 0.15
    logp, prox, adv, mask = _one_row([1.5, 1.5, 0.5, 0.5], [1.0, -1.0, 1.0, -1.0])
    loss, stats = ppo_loss_with(logp, prox, adv, mask, eps_clip=0.2)
    assert_close(loss, torch.tensor(0.15), rtol=0, atol=1e-6)
    assert_close(_avg(stats, "clip_ratio"), torch.tensor(0.5), rtol=0, atol=0)
    assert_close(_avg(stats, "importance_weight"), torch.tensor(1.0), rtol=0, atol=1e-6)
    # d loss / d logp_t = -A ρ / 4 where unclipped, 0 where clipped:
    # t1: -(-1)(1.5)/4 = 0.375 ; t2: -(1)(0.5)/4 = -0.125
    loss.backward()
    assert_close(logp.grad, torch.tensor([[0.0, 0.375, -0.125, 0.0]]), rtol=0, atol=1e-6)
    check_stat_names(stats)


def test_clip_higher_and_dual_clip_hand_computed() -> None:
    # clip-higher ε_high=0.28: ratio 1.25, A=+1 stays unclipped -> -1.25 (symmetric 0.2: -1.2)
    logp, prox, adv, mask = _one_row([1.25], [1.0])
    sym, _ = ppo_loss_with(logp, prox, adv, mask, eps_clip=0.2)
    high, _ = ppo_loss_with(logp, prox, adv, mask, eps_clip=0.2, eps_clip_higher=0.28)
    assert_close(sym, torch.tensor(-1.2), rtol=0, atol=1e-6)
    assert_close(high, torch.tensor(-1.25), rtol=0, atol=1e-6)
    # dual clip c=3: ratio 4, A=-1: max(4, 1.2) = 4 -> min(4, 3) = 3, and no gradient.
    # For A=+1 it never binds: ratio 4 -> max(-4, -1.2) = -1.2.
    logp, prox, adv, mask = _one_row([4.0, 4.0], [-1.0, 1.0])
    loss, stats = ppo_loss_with(logp, prox, adv, mask, eps_clip=0.2, c_clip=3.0)
    assert_close(loss, torch.tensor((3.0 - 1.2) / 2), rtol=0, atol=1e-6)
    assert_close(_avg(stats, "dual_clip_ratio"), torch.tensor(0.5), rtol=0, atol=0)
    loss.backward()
    assert_close(logp.grad, torch.zeros(1, 2), rtol=0, atol=0)
    with pytest.raises(ValueError, match="dual-clip bound must be > 1"):
        ppo_loss_with(logp, prox, adv, mask, c_clip=0.9)


def test_ratio_one_gives_minus_token_mean_advantage(gen: torch.Generator) -> None:
    logp = torch.randn(5, 7, generator=gen)
    adv = torch.randn(5, 7, generator=gen)
    mask = torch.rand(5, 7, generator=gen) < 0.6
    for surrogate in ("clip", "sapo", "cispo"):
        lp = logp.clone().requires_grad_(True)
        loss, stats = ppo_loss_with(lp, logp, adv, mask, surrogate=surrogate, eps_clip_higher=0.28)
        expected = -(adv * mask).sum() / mask.sum()
        if surrogate == "sapo":
            # SAPO at ρ=1 is (4/τ)σ(0) = 2/τ times the advantage: τ_pos=1 -> 2, τ_neg=1.05
            scale = torch.where(adv > 0, 2.0, 2.0 / 1.05)
            expected = -(adv * scale * mask).sum() / mask.sum()
        if surrogate == "cispo":
            # CISPO's value is -w A log π_θ with w = 1
            expected = -(adv * logp * mask).sum() / mask.sum()
        assert_close(loss, expected, rtol=1e-6, atol=1e-6)
        assert _avg(stats, "clip_ratio") == 0


@pytest.mark.parametrize("tau_pos,tau_neg", [(1.0, 1.05), (3.0, 0.5)])
def test_sapo_gradient_at_ratio_one_equals_policy_gradient(
    tau_pos: float, tau_neg: float, gen: torch.Generator
) -> None:
    logp0 = torch.randn(3, 6, generator=gen)
    adv = torch.randn(3, 6, generator=gen)
    mask = torch.rand(3, 6, generator=gen) < 0.8
    sapo_lp = logp0.clone().requires_grad_(True)
    loss, _ = ppo_loss_with(
        sapo_lp, logp0, adv, mask, surrogate="sapo", sapo_tau_pos=tau_pos, sapo_tau_neg=tau_neg
    )
    loss.backward()
    pg_lp = logp0.clone().requires_grad_(True)
    # plain policy gradient: -A ρ, token-mean
    pg = -(adv * torch.exp(pg_lp - logp0) * mask).sum() / mask.sum()
    pg.backward()
    assert_close(sapo_lp.grad, pg_lp.grad, rtol=1e-6, atol=1e-7)


def _analytic_grad(
    surrogate: str, ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, **kw: float
) -> torch.Tensor:
    """d(token-mean loss)/d logp from the formulas in surrogates.py."""
    n = mask.sum()
    if surrogate == "clip":
        lo, hi = 1 - kw["eps_clip"], 1 + kw["eps_clip_higher"]
        clipped = torch.where(adv >= 0, ratio > hi, ratio < lo)
        g = torch.where(clipped, 0.0, -adv * ratio)
    elif surrogate == "sapo":
        tau = torch.where(adv > 0, kw["sapo_tau_pos"], kw["sapo_tau_neg"])
        s = torch.sigmoid(tau * (ratio - 1))
        g = -adv * 4 * s * (1 - s) * ratio
    else:  # cispo
        w = ratio.clamp(max(0.0, 1 - kw["eps_clip"]), 1 + kw["eps_clip_higher"])
        g = -w * adv
    return torch.where(mask, g, 0.0) / n


@pytest.mark.parametrize("surrogate", ["clip", "sapo", "cispo"])
def test_autograd_gradient_matches_formula(surrogate: str, gen: torch.Generator) -> None:
    prox = torch.randn(4, 8, generator=gen) - 2
    logp0 = prox + 0.4 * torch.randn(4, 8, generator=gen)
    adv = torch.randn(4, 8, generator=gen)
    mask = torch.rand(4, 8, generator=gen) < 0.7
    kw = dict(eps_clip=0.2, eps_clip_higher=0.28, sapo_tau_pos=1.0, sapo_tau_neg=1.05)
    logp = logp0.clone().requires_grad_(True)
    loss, _ = ppo_loss_with(logp, prox, adv, mask, surrogate=surrogate, **kw)
    loss.backward()
    expected = _analytic_grad(surrogate, torch.exp(logp0 - prox), adv, mask, **kw)
    assert_close(logp.grad, expected, rtol=1e-5, atol=1e-7)


# CISPO is left out on purpose: its weight is stop-gradient, so finite differences of its
# value disagree with its gradient by design; test_autograd_gradient_matches_formula covers it.
@pytest.mark.parametrize("surrogate", ["clip", "sapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_gradcheck_in_double(surrogate: str, level: str, gen: torch.Generator) -> None:
    prox = (torch.randn(3, 5, generator=gen) - 1).double()
    # keep ratios away from the clip kinks so finite differences are valid
    logp0 = prox + 0.02 * torch.randn(3, 5, generator=gen).double()
    adv = torch.randn(3, 5, generator=gen).double()
    mask = torch.rand(3, 5, generator=gen) < 0.8

    def f(lp: torch.Tensor) -> torch.Tensor:
        return ppo_loss_with(
            lp, prox, adv, mask, surrogate=surrogate, importance_sampling_level=level
        )[0]

    assert torch.autograd.gradcheck(f, (logp0.clone().requires_grad_(True),), eps=1e-6, atol=1e-6)


def test_gspo_sequence_ratio_hand_computed() -> None:
    prox = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.1, 0.9, 5.0]])).requires_grad_(True)
    adv = torch.tensor([[1.0, 3.0, 100.0]])
    mask = torch.tensor([[True, True, False]])
    loss, stats = ppo_loss_with(
        logp, prox, adv, mask, importance_sampling_level="sequence", eps_clip=0.2
    )
    # ρ_seq = exp((ln 1.1 + ln 0.9)/2) = sqrt(0.99) = 0.9949874 ; A_seq = (1 + 3)/2 = 2
    # per token -2 * 0.9949874 ; token-mean over 2 tokens = -1.9899749
    assert_close(loss, torch.tensor(-2 * math.sqrt(0.99)), rtol=0, atol=1e-6)
    assert_close(_avg(stats, "importance_weight"), torch.tensor(math.sqrt(0.99)), rtol=0, atol=1e-6)
    # d/d logp_t of -(1/2) Σ_t A_seq ρ_seq = -A_seq ρ_seq / |o| = -2*0.9949874/2 for both tokens
    loss.backward()
    g = -math.sqrt(0.99)
    assert_close(logp.grad, torch.tensor([[g, g, 0.0]]), rtol=0, atol=1e-6)
    # the schema refuses CISPO with sequence-level ratios, at load
    with pytest.raises(ValueError, match="CISPO is defined per token only"):
        loss_view(surrogate="cispo", eps_clip_higher=0.28, importance_sampling_level="sequence")


def test_decoupled_loss_multiplies_by_behaviour_weight() -> None:
    # π_prox/π_behave = 2, ratio π_θ/π_prox = 1, A = 1 -> per token -1 * 2
    behave = torch.tensor([[-2.0 - math.log(2.0), -1.0]])
    prox = torch.tensor([[-2.0, -1.0]])
    logp = prox.clone().requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, stats = ppo_loss_with(
        logp, prox, adv, mask, behave_logprobs=behave, use_decoupled_loss=True
    )
    # tokens: -1*2 and -1*1 -> mean -1.5
    assert_close(loss, torch.tensor(-1.5), rtol=0, atol=1e-6)
    assert_close(_avg(stats, "behave_imp_weight"), torch.tensor(1.5), rtol=0, atol=1e-6)
    assert_close(_avg(stats, "behave_approx_kl"), torch.tensor(math.log(2) / 2), rtol=0, atol=1e-6)
    none, _ = ppo_loss_with(
        logp,
        prox,
        adv,
        mask,
        behave_logprobs=behave,
        use_decoupled_loss=True,
        decoupled_correction="none",
    )
    assert_close(none, torch.tensor(-1.0), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="needs behave_logprobs"):
        ppo_loss_with(logp, prox, adv, mask, use_decoupled_loss=True)
    with pytest.raises(ValueError, match="exists only with the decoupled loss"):
        ppo_loss_with(logp, prox, adv, mask, rejection_sampling=RejectionSamplingConfig())


def test_unknown_surrogate_lists_valid_ones() -> None:
    logp, prox, adv, mask = _one_row([1.0], [1.0])
    with pytest.raises(RegistryError, match="valid: cispo, clip, sapo"):
        SURROGATES.get("trpo")
    with pytest.raises(ValueError, match="must be one of clip, sapo, cispo"):
        ppo_loss_with(logp, prox, adv, mask, surrogate="trpo")


def test_clip_matches_plain_loop(gen: torch.Generator) -> None:
    prox = torch.randn(6, 10, generator=gen)
    logp = prox + 0.5 * torch.randn(6, 10, generator=gen)
    adv = torch.randn(6, 10, generator=gen)
    mask = torch.rand(6, 10, generator=gen) < 0.7
    loss, _ = ppo_loss_with(logp, prox, adv, mask, eps_clip=0.2, eps_clip_higher=0.3, c_clip=2.5)
    total, n = 0.0, 0
    for i in range(6):
        for t in range(10):
            if mask[i, t]:
                r = math.exp(float(logp[i, t] - prox[i, t]))
                total += ref.clip_token_loss(r, float(adv[i, t]), 0.2, 0.3, 2.5)
                n += 1
    assert_close(loss, torch.tensor(total / n), rtol=1e-5, atol=1e-6)


def _random_batch(gen: torch.Generator, b: int = 5, t: int = 9) -> dict[str, torch.Tensor]:
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    valid = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    mask = valid & (torch.rand(b, t, generator=gen) < 0.8)
    mask[:, 0] = True  # every sequence has at least one token
    prox = torch.randn(b, t, generator=gen) - 1.5
    return {
        "logprobs": prox + 0.3 * torch.randn(b, t, generator=gen),
        "proximal_logprobs": prox,
        "behave_logprobs": prox - 0.4 * torch.rand(b, t, generator=gen),
        "advantages": torch.randn(b, t, generator=gen),
        "loss_mask": mask,
        "valid": valid,
        "lengths": lengths,
        "entropy": torch.rand(b, t, generator=gen),
        "versions": torch.randint(0, 4, (b, t), generator=gen),
    }


OPTION_SETS = [
    {},
    {"importance_sampling_level": "sequence"},
    {"surrogate": "sapo"},
    {"surrogate": "cispo", "eps_clip": 1.0, "eps_clip_higher": 4.0},
    {"c_clip": 3.0, "eps_clip_higher": 0.28},
    {"use_decoupled_loss": True},
    {
        "use_decoupled_loss": True,
        "rejection_sampling": RejectionSamplingConfig(lower=0.8, upper=1.3),
    },
    {
        "use_decoupled_loss": True,
        "rejection_sampling": RejectionSamplingConfig(level="sequence", metric="kl_k3", upper=0.05),
    },
    {
        "use_decoupled_loss": True,
        "rejection_sampling": RejectionSamplingConfig(action="clamp", upper=1.2),
    },
    {
        "use_decoupled_loss": True,
        "rejection_sampling": RejectionSamplingConfig(metric="binary_kl", upper=0.05),
    },
    {"m2_threshold": 0.05},
    {"loss_agg_mode": "seq-mean-token-mean"},
    {"loss_agg_mode": "seq-mean-token-sum-norm", "loss_agg_norm": 16.0},
]


@pytest.mark.parametrize(
    "options", OPTION_SETS, ids=lambda o: ",".join(f"{k}" for k in o) or "default"
)
def test_packed_layout_equals_padded(options: dict, gen: torch.Generator) -> None:
    data = _random_batch(gen)
    valid, lengths = data.pop("valid"), data.pop("lengths")
    per_token = {k: v for k, v in data.items()}
    lp_pad = per_token.pop("logprobs").clone().requires_grad_(True)
    loss_pad, st_pad = ppo_loss_with(
        lp_pad, current_version=4, attention_mask=valid, **per_token, **options
    )
    loss_pad.backward()
    packed = {k: padded_to_packed(v, lengths)[0] for k, v in per_token.items()}
    cu = padded_to_packed(per_token["loss_mask"], lengths)[1]
    lp_pack = padded_to_packed(lp_pad.detach(), lengths)[0].requires_grad_(True)
    loss_pack, st_pack = ppo_loss_with(
        lp_pack, cu_seqlens=cu, current_version=4, **packed, **options
    )
    loss_pack.backward()
    assert_close(loss_pack, loss_pad, rtol=1e-6, atol=1e-6)
    assert_close(lp_pack.grad, lp_pad.grad[valid], rtol=1e-6, atol=1e-6)
    rep_pack, rep_pad = _reported(st_pack), _reported(st_pad)
    assert rep_pack.keys() == rep_pad.keys()
    for k in rep_pad:
        assert_close(rep_pack[k], rep_pad[k], rtol=1e-5, atol=1e-6, msg=k)
    check_stat_names(st_pad)


@pytest.mark.parametrize(
    "options", OPTION_SETS, ids=lambda o: ",".join(f"{k}" for k in o) or "default"
)
def test_masked_positions_never_leak(options: dict, gen: torch.Generator) -> None:
    data = _random_batch(gen)
    data.pop("valid"), data.pop("lengths")
    mask = data["loss_mask"]
    clean = {k: v for k, v in data.items()}
    dirty = {}
    for k, v in data.items():
        if k in ("loss_mask", "versions"):
            dirty[k] = v
        else:
            junk = torch.full_like(v, float("nan")) if k != "entropy" else torch.full_like(v, 1e6)
            dirty[k] = torch.where(mask, v, junk)
    lp_c = clean.pop("logprobs").clone().requires_grad_(True)
    lp_d = dirty.pop("logprobs").clone().requires_grad_(True)
    loss_c, st_c = ppo_loss_with(lp_c, **clean, **options)
    loss_d, st_d = ppo_loss_with(lp_d, **dirty, **options)
    loss_c.backward()
    loss_d.backward()
    assert torch.isfinite(loss_d)
    assert_close(loss_d, loss_c, rtol=0, atol=0)
    assert bool(torch.isfinite(lp_d.grad).all())
    assert_close(lp_d.grad, lp_c.grad, rtol=0, atol=0)
    assert bool((lp_d.grad[~mask] == 0).all())
    rep_c, rep_d = _reported(st_c), _reported(st_d)
    assert rep_c.keys() == rep_d.keys()
    for k in rep_c:
        assert_close(rep_d[k], rep_c[k], rtol=0, atol=0, msg=k)


def test_non_finite_inputs_on_loss_tokens_raise() -> None:
    logp, prox, adv, mask = _one_row([1.0, 1.0], [1.0, 1.0])
    adv[0, 1] = float("nan")
    with pytest.raises(ValueError, match="advantages has 1 NaN/Inf"):
        ppo_loss_with(logp, prox, adv, mask)


def test_staleness_and_entropy_stats() -> None:
    logp, prox, adv, mask = _one_row([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    versions = torch.tensor([[3, 5, 6]])
    entropy = torch.tensor([[0.5, 1.0, 1.5]])
    _, stats = ppo_loss_with(
        logp, prox, adv, mask, versions=versions, current_version=6, entropy=entropy
    )
    # staleness = 6 - v: [3, 1, 0] -> avg 4/3, min 0, max 3 ; entropy mean 1.0
    assert_close(stats["staleness_avg"], torch.tensor(4 / 3), rtol=0, atol=1e-6)
    assert stats["staleness_min"] == 0 and stats["staleness_max"] == 3
    assert_close(_avg(stats, "entropy"), torch.tensor(1.0), rtol=0, atol=1e-6)


def test_critic_loss_value_clipping_hand_computed() -> None:
    values = torch.tensor([[1.0, 2.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.0, 2.0, 0.0]])
    returns = torch.tensor([[0.0, 3.0, 9.0]])
    mask = torch.tensor([[True, True, False]])
    loss, stats = critic_loss_with(values, old, returns, mask, eps_clip=0.5)
    # t0: unclipped ½(1-0)² = 0.5; clipped V = 0 + clip(1, ±0.5) = 0.5 -> ½(0.5)² = 0.125;
    #     max = 0.5 (unclipped wins, clip does not bind)
    # t1: V = old = 2, both ½(2-3)² = 0.5
    # mean over 2 tokens = 0.5
    assert_close(loss, torch.tensor(0.5), rtol=0, atol=1e-6)
    assert _avg(stats, "value_clip_ratio", critic=True) == 0
    loss.backward()
    # d/dV of ½(V-G)²/2: t0 (1-0)/2 = 0.5 ; t1 (2-3)/2 = -0.5
    assert_close(values.grad, torch.tensor([[0.5, -0.5, 0.0]]), rtol=0, atol=1e-6)
    # Clip binds when the new value moved away from the target beyond ε:
    # V=-1, old=0, G=1: unclipped ½*4 = 2; clipped V=-0.5 -> ½*2.25 = 1.125; max = 2 (unclipped)
    # V=2, old=0, G=-1: unclipped ½*9 = 4.5; clipped V=0.5 -> ½*2.25 = 1.125 -> 4.5
    # V=0.2, old=1, G=1: unclipped ½*0.64 = 0.32; clipped V=0.5 -> 0.125 -> 0.32
    # Target between: V=3, old=0, G=2: unclipped 0.5, clipped V=0.5 -> ½*2.25 = 1.125 binds
    v = torch.tensor([[3.0]], requires_grad=True)
    loss, stats = critic_loss_with(
        v, torch.zeros(1, 1), torch.tensor([[2.0]]), torch.ones(1, 1, dtype=torch.bool)
    )
    assert_close(loss, torch.tensor(1.125), rtol=0, atol=1e-6)
    assert _avg(stats, "value_clip_ratio", critic=True) == 1
    loss.backward()
    assert v.grad is not None and v.grad.item() == 0.0  # the clipped branch has no gradient
    check_stat_names(stats)


def test_critic_huber_hand_computed() -> None:
    values = torch.tensor([[0.5, 4.0]], requires_grad=True)
    ret = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, _ = critic_loss_with(
        values, values.detach(), ret, mask, value_loss="huber", huber_delta=1.0
    )
    # |d|=0.5 < 1: ½*0.25 = 0.125 ; |d|=4: 1*(4 - 0.5) = 3.5 ; mean = 1.8125
    assert_close(loss, torch.tensor(1.8125), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="value_loss"):
        critic_loss_with(values, values, ret, mask, value_loss="l1")


def test_sapo_and_cispo_hand_computed() -> None:
    # SAPO, ρ = 1.5, A = +1, τ_pos = 1: gate = (4/1) σ(0.5) = 4 * 0.6224593 = 2.4898373
    # ρ = 0.5, A = -1, τ_neg = 2: gate = (4/2) σ(-1) = 2 * 0.2689414 = 0.5378828 -> loss +0.5378828
    logp, prox, adv, mask = _one_row([1.5, 0.5], [1.0, -1.0])
    loss, stats = ppo_loss_with(
        logp, prox, adv, mask, surrogate="sapo", sapo_tau_pos=1.0, sapo_tau_neg=2.0
    )
    assert_close(loss, torch.tensor((-2.4898373 + 0.5378828) / 2), rtol=0, atol=1e-6)
    assert_close(
        _avg(stats, "sapo_soft_gate"), torch.tensor((2.4898373 + 0.5378828) / 2), rtol=0, atol=1e-6
    )
    # CISPO, ρ = 2, A = +1, ε_low = 1 (no lower bound), ε_high = 0.28: weight 1.28 (clipped);
    # log π_θ = -1 + ln 2 = -0.3068528 -> loss = -1.28 * 1 * -0.3068528 = 0.3927716
    logp, prox, adv, mask = _one_row([2.0], [1.0])
    loss, stats = ppo_loss_with(
        logp, prox, adv, mask, surrogate="cispo", eps_clip=1.0, eps_clip_higher=0.28
    )
    assert_close(loss, torch.tensor(0.3927716), rtol=0, atol=1e-6)
    assert _avg(stats, "clip_ratio") == 1.0
    loss.backward()
    # the clipped token keeps a gradient: -1.28 * A
    assert_close(logp.grad, torch.tensor([[-1.28]]), rtol=0, atol=1e-6)


def test_critic_packed_equals_padded(gen: torch.Generator) -> None:
    lengths = torch.tensor([3, 1, 4])
    valid = torch.arange(4).unsqueeze(0) < lengths.unsqueeze(1)
    v = torch.randn(3, 4, generator=gen)
    old = v + 0.8 * torch.randn(3, 4, generator=gen)
    ret = torch.randn(3, 4, generator=gen)
    pad, _ = critic_loss_with(v, old, ret, valid, loss_agg_mode="seq-mean-token-mean")
    cu = padded_to_packed(valid, lengths)[1]
    packed, _ = critic_loss_with(
        v[valid],
        old[valid],
        ret[valid],
        valid[valid],
        cu_seqlens=cu,
        loss_agg_mode="seq-mean-token-mean",
    )
    assert_close(packed, pad, rtol=1e-6, atol=1e-7)


# -- AReaL 2.0's per-token statistics and their masks ------------------------------------


def _rs_row(ratios: list[float], behave_w: list[float]) -> dict[str, torch.Tensor]:
    """π_prox = e^-1 per token, π_θ/π_prox = `ratios`, π_prox/π_behave = `behave_w`, A = 1."""
    prox = torch.full((1, len(ratios)), -1.0)
    return {
        "logprobs": (prox + torch.log(torch.tensor([ratios]))).requires_grad_(True),
        "proximal_logprobs": prox,
        "behave_logprobs": prox - torch.log(torch.tensor([behave_w])),
        "advantages": torch.ones(1, len(ratios)),
        "loss_mask": torch.ones(1, len(ratios), dtype=torch.bool),
    }


ICE = RejectionSamplingConfig(level="token", action="mask", metric="ratio", upper=2.0)


def test_rejection_sampling_statistics_follow_areal_2() -> None:
    # AReaL 2.0 `ppo_actor_loss_fn` (areal/utils/functional/functional.py) with rejection
    # sampling and `grpo_loss_fn` (areal/trainer/ppo/actor.py) for the denominators.
    # ratios [1.5, 0.5, 1.0], behaviour weights [1, 4, 1]; upper 2 rejects token 1.
    # Loss: max(-ρA, -clip(ρ)A) = [-1.2, -0.5, -1.0] x weight [1, 0, 1] over the post-
    # rejection mask, divided by the pre-rejection count 3: (-1.2 - 1.0)/3 = -0.7333333.
    # Stats over the pre-rejection mask: importance_weight (1.5 + 0.5 + 1)/3 = 1,
    # clip_ratio 1/3 (token 0; token 1 is rejected but still counted, ratio 0.5 unclipped
    # for A > 0); behave_* over behave_mask = weight > 0 & kept = tokens 0, 2: weight 1,
    # approx KL 0; behave_filtered_ratio 1/3; filtered_fraction 1/3.
    loss, stats = ppo_loss_with(
        **_rs_row([1.5, 0.5, 1.0], [1.0, 4.0, 1.0]), use_decoupled_loss=True, rejection_sampling=ICE
    )
    assert_close(loss, torch.tensor(-2.2 / 3), rtol=0, atol=1e-6)
    rep = summarize_token_stats(stats, ACTOR_TOKEN_STATS)
    assert_close(rep["importance_weight/avg"], torch.tensor(1.0), rtol=0, atol=1e-6)
    assert_close(rep["importance_weight/min"], torch.tensor(0.5), rtol=0, atol=1e-6)
    assert_close(rep["clip_ratio/avg"], torch.tensor(1 / 3), rtol=0, atol=1e-6)
    assert_close(rep["behave_imp_weight/avg"], torch.tensor(1.0), rtol=0, atol=1e-6)
    assert_close(rep["behave_imp_weight/max"], torch.tensor(1.0), rtol=0, atol=1e-6)
    assert_close(rep["behave_approx_kl/avg"], torch.tensor(0.0), rtol=0, atol=1e-6)
    assert_close(rep["behave_filtered_ratio/avg"], torch.tensor(1 / 3), rtol=0, atol=1e-6)
    assert_close(stats["filtered_fraction"], torch.tensor(1 / 3), rtol=0, atol=1e-6)
    assert stats["loss_mask"].tolist() == [[True, True, True]]  # the statistics mask
    assert stats["behave_mask"].tolist() == [[True, False, True]]
    assert stats["importance_weight"].shape == (1, 3)  # per-token tensors, AReaL's names
    check_stat_names(stats)


def test_gspo_with_rejection_sampling_reports_zero_ratio_on_rejected_tokens() -> None:
    # AReaL `_compute_sequence_level_ratio_and_advantages`: the sequence ratio is taken over
    # the post-rejection mask and is 0 elsewhere; the statistics divide by the pre-rejection
    # count. Kept tokens 0, 2: ρ_seq = exp((ln 1.5 + ln 1)/2) = sqrt(1.5) = 1.2247449,
    # importance_weight/avg = 2 * 1.2247449 / 3 = 0.8164966. A_seq = 1; clipped to 1.2 on
    # both kept tokens: loss (-1.2 - 1.2)/3 = -0.8, clip_ratio 2/3.
    loss, stats = ppo_loss_with(
        **_rs_row([1.5, 0.5, 1.0], [1.0, 4.0, 1.0]),
        use_decoupled_loss=True,
        rejection_sampling=ICE,
        importance_sampling_level="sequence",
    )
    assert_close(loss, torch.tensor(-0.8), rtol=0, atol=1e-6)
    rep = summarize_token_stats(stats, ACTOR_TOKEN_STATS)
    assert_close(
        rep["importance_weight/avg"], torch.tensor(2 * math.sqrt(1.5) / 3), rtol=0, atol=1e-6
    )
    assert_close(rep["importance_weight/min"], torch.tensor(0.0), rtol=0, atol=0)
    assert_close(rep["clip_ratio/avg"], torch.tensor(2 / 3), rtol=0, atol=1e-6)


def test_cispo_clip_mask_is_over_the_post_rejection_mask() -> None:
    # AReaL `cispo_loss_fn`: clip_mask = (clip(ρ) != ρ) & loss_mask after rejection sampling.
    # ratios [1.5, 2.0, 1.0], band [0, 1.2]: tokens 0 and 1 leave it, but token 1 is
    # rejected (behaviour weight 4 > 2): clip_ratio/avg = 1/3 over the 3 statistics tokens.
    # Loss -sg(clip ρ) A log π_θ over kept tokens / 3: log π_θ = -1 + ln 1.5, -1 + ln 1:
    # -(1.2 (-1 + ln 1.5) + 1.0 (-1)) / 3
    data = _rs_row([1.5, 2.0, 1.0], [1.0, 4.0, 1.0])
    loss, stats = ppo_loss_with(
        **data,
        surrogate="cispo",
        eps_clip=1.0,
        eps_clip_higher=0.2,
        use_decoupled_loss=True,
        rejection_sampling=ICE,
    )
    expected = -(1.2 * (-1 + math.log(1.5)) + 1.0 * -1.0) / 3
    assert_close(loss, torch.tensor(expected), rtol=0, atol=1e-6)
    rep = summarize_token_stats(stats, ACTOR_TOKEN_STATS)
    assert_close(rep["clip_ratio/avg"], torch.tensor(1 / 3), rtol=0, atol=1e-6)
    # the PPO clip on the same data counts the rejected token's clip too: 2/3
    _, clip_stats = ppo_loss_with(**data, use_decoupled_loss=True, rejection_sampling=ICE)
    rep = summarize_token_stats(clip_stats, ACTOR_TOKEN_STATS)
    assert_close(rep["clip_ratio/avg"], torch.tensor(2 / 3), rtol=0, atol=1e-6)


def test_sapo_reports_areals_three_gates() -> None:
    # AReaL `sapo_loss_fn`: sapo_soft_gate (the one of the token's sign) and both scaled
    # gates. ρ = 1.5, A = -1, τ_pos = 1, τ_neg = 2: pos = 4 σ(0.5) = 2.4898373,
    # neg = 2 σ(1.0) = 1.4621172, soft = neg.
    logp, prox, adv, mask = _one_row([1.5], [-1.0])
    _, stats = ppo_loss_with(
        logp, prox, adv, mask, surrogate="sapo", sapo_tau_pos=1.0, sapo_tau_neg=2.0
    )
    rep = summarize_token_stats(stats, ACTOR_TOKEN_STATS)
    assert_close(rep["sapo_scaled_gate_pos/avg"], torch.tensor(2.4898373), rtol=0, atol=1e-6)
    assert_close(rep["sapo_scaled_gate_neg/avg"], torch.tensor(1.4621172), rtol=0, atol=1e-6)
    assert_close(rep["sapo_soft_gate/avg"], torch.tensor(1.4621172), rtol=0, atol=1e-6)


# -- on-policy distillation (AReaL 2.0 teacher term) ------------------------------------


def test_teacher_term_with_the_rl_loss_hand_computed() -> None:
    # AReaL 2.0 `grpo_loss_fn` (areal/trainer/ppo/actor.py), rl_loss_weight > 0:
    # loss = rl_w L_RL + w_d Σ (log π_θ - log π_T) m / Σ m.
    # log π_θ = π_prox = [-1, -2] (ρ = 1), A = 1: L_RL = -1; teacher [-1.5, -1.0]:
    # penalty [0.5, -1.0], mean -0.25; rl_w = 1, w_d = 0.5: loss = -1 - 0.125 = -1.125.
    # d/d log π_θ: -A ρ / 2 + 0.5 / 2 = -0.5 + 0.25 = -0.25 on both tokens.
    prox = torch.tensor([[-1.0, -2.0]])
    logp = prox.clone().requires_grad_(True)
    adv, mask = torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool)
    teacher = torch.tensor([[-1.5, -1.0]])
    loss, stats = ppo_loss_with(
        logp, prox, adv, mask, teacher_logprobs=teacher, rl_loss_weight=1.0, distill_loss_weight=0.5
    )
    assert_close(loss, torch.tensor(-1.125), rtol=0, atol=1e-6)
    loss.backward()
    assert_close(logp.grad, torch.tensor([[-0.25, -0.25]]), rtol=0, atol=1e-6)
    assert_close(_avg(stats, "rkl_loss"), torch.tensor(-0.25), rtol=0, atol=1e-6)
    check_stat_names(stats)


@pytest.mark.parametrize("decoupled", [False, True])
def test_teacher_term_alone_is_the_importance_weighted_reverse_kl(decoupled: bool) -> None:
    # AReaL 2.0 `grpo_loss_fn`, rl_loss_weight == 0 (pure distillation):
    # loss = -w_d Σ w (log π_T - sg(log π_θ)) m / Σ m, w = π_θ/π_old, π_old = the input
    # `logprobs` (π_behave with the decoupled loss, else π_prox here).
    # log π_θ = [-1, -1], π_old = [-1 - ln 2, -1] -> w = [2, 1]; teacher [-1.5, -1.5]:
    # term = [2 (-0.5), 1 (-0.5)] = [-1, -0.5], mean -0.75; w_d = 0.5 -> loss 0.375.
    # gradient (dw/dlogp = w): -0.5/2 * w (π_T - π_θ) = -0.25 [-1, -0.5] = [0.25, 0.125].
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.0 - math.log(2.0), -1.0]])
    adv, mask = torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool)
    kw: dict = {"teacher_logprobs": torch.tensor([[-1.5, -1.5]]), "rl_loss_weight": 0.0}
    kw["distill_loss_weight"] = 0.5
    if decoupled:  # π_prox is something else; the weight uses π_behave
        loss, stats = ppo_loss_with(
            logp, logp.detach() - 0.3, adv, mask, behave_logprobs=old, use_decoupled_loss=True, **kw
        )
    else:
        loss, stats = ppo_loss_with(logp, old, adv, mask, **kw)
    assert_close(loss, torch.tensor(0.375), rtol=0, atol=1e-6)
    loss.backward()
    assert_close(logp.grad, torch.tensor([[0.25, 0.125]]), rtol=0, atol=1e-6)
    # rkl_loss = -term = [1, 0.5] -> avg 0.75
    assert_close(_avg(stats, "rkl_loss"), torch.tensor(0.75), rtol=0, atol=1e-6)


def test_critic_huber_delta_defaults_to_areals_ten() -> None:
    # AReaL `ppo_critic_loss_fn`: Huber with delta=10.0. |d| = 0.5 -> ½ 0.25 = 0.125;
    # |d| = 12 -> 10 (12 - 5) = 70 (with δ = 1 it would be 11.5); mean 35.0625.
    values = torch.tensor([[0.5, 12.0]], requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, stats = critic_loss_with(
        values, values.detach(), torch.zeros(1, 2), mask, value_loss="huber"
    )
    assert_close(loss, torch.tensor(35.0625), rtol=0, atol=1e-5)
    # per-token statistics, AReaL's names (areal/trainer/ppo/critic.py `ppo_loss_fn`)
    rep = summarize_token_stats(stats, CRITIC_TOKEN_STATS)
    assert_close(rep["critic_loss/max"], torch.tensor(70.0), rtol=0, atol=1e-5)
    assert_close(rep["new_value/avg"], torch.tensor(6.25), rtol=0, atol=1e-6)
    from services.common.config import PPOCriticConfig

    assert PPOCriticConfig().huber_delta == 10.0


def _areal_micro_batch_loop(
    logp: list[float],
    prox: list[float],
    behave: list[float],
    adv: list[float],
    *,
    eps: float,
    upper: float,
    lower: float,
    m2: float | None,
) -> dict[str, float]:
    """AReaL 2.0's `grpo_loss_fn` → `ppo_actor_loss_fn` on one micro-batch, token by token,
    written from its formulas (areal/trainer/ppo/actor.py, areal/utils/functional/
    functional.py): M2PO on the input mask, ratio-metric rejection sampling (mask) on the
    result, PPO clip, loss over the post-rejection tokens divided by the post-M2PO count."""
    n = len(logp)
    keep = [True] * n
    if m2 is not None:
        order = sorted(range(n), key=lambda i: (behave[i] - prox[i]) ** 2, reverse=True)
        vals = [(behave[i] - prox[i]) ** 2 for i in order]
        cut = next((k for k in range(n) if sum(vals[k:]) / (n - k) < m2), n - 1)
        for i in order[:cut]:
            keep[i] = False
    stat = [i for i in range(n) if keep[i]]
    w = {i: math.exp(prox[i] - behave[i]) for i in stat}
    kept = [i for i in stat if lower <= w[i] <= upper]
    total, clipped = 0.0, 0
    for i in stat:
        r = math.exp(logp[i] - prox[i])
        l1, l2 = -adv[i] * r, -adv[i] * min(max(r, 1 - eps), 1 + eps)
        clipped += l1 < l2
        if i in kept:
            total += max(l1, l2) * w[i]
    return {
        "loss": total / len(stat),
        "importance_weight/avg": sum(math.exp(logp[i] - prox[i]) for i in stat) / len(stat),
        "clip_ratio/avg": clipped / len(stat),
        "behave_imp_weight/avg": sum(w[i] for i in kept) / len(kept),
        "behave_approx_kl/avg": sum(prox[i] - behave[i] for i in kept) / len(kept),
        "filtered_fraction": (len(stat) - len(kept)) / len(stat),
    }


@pytest.mark.parametrize("m2", [None, 0.02, 1e-6])
def test_loss_and_statistics_equal_an_areal_loop(m2: float | None, gen: torch.Generator) -> None:
    # random micro-batches of 24 tokens; IcePop bounds [0.8, 1.25] reject some tokens,
    # M2PO (0.02) masks some, 1e-6 leaves the single smallest-M2 token.
    for _ in range(5):
        prox = torch.randn(1, 24, generator=gen, dtype=torch.float64) - 1.0
        behave = prox - 0.2 * torch.randn(1, 24, generator=gen, dtype=torch.float64)
        logp = prox + 0.3 * torch.randn(1, 24, generator=gen, dtype=torch.float64)
        adv = torch.randn(1, 24, generator=gen, dtype=torch.float64)
        spec = RejectionSamplingConfig(lower=0.8, upper=1.25)
        loss, stats = ppo_loss_with(
            logp,
            prox,
            adv,
            torch.ones(1, 24, dtype=torch.bool),
            behave_logprobs=behave,
            use_decoupled_loss=True,
            rejection_sampling=spec,
            m2_threshold=m2,
            eps_clip=0.2,
        )
        want = _areal_micro_batch_loop(
            logp[0].tolist(),
            prox[0].tolist(),
            behave[0].tolist(),
            adv[0].tolist(),
            eps=0.2,
            upper=1.25,
            lower=0.8,
            m2=m2,
        )
        if not want["filtered_fraction"] < 1:
            continue  # every token rejected: no behaviour statistics to compare
        rep = summarize_token_stats(stats, ACTOR_TOKEN_STATS)
        assert float(loss) == pytest.approx(want["loss"], rel=1e-6, abs=1e-7)
        assert float(stats["filtered_fraction"]) == pytest.approx(want["filtered_fraction"])
        for k in ("importance_weight/avg", "clip_ratio/avg", "behave_imp_weight/avg"):
            assert float(rep[k]) == pytest.approx(want[k], rel=1e-5, abs=1e-6), k
        assert float(rep["behave_approx_kl/avg"]) == pytest.approx(
            want["behave_approx_kl/avg"], rel=1e-5, abs=1e-6
        )


def _count_case(**kwargs: object) -> dict[str, torch.Tensor]:
    # Two sequences packed like one AReaL micro-batch: [p, g, g, g] and [p, p, g]
    # (loss tokens 1, 2, 3 and 6). π_prox - π_behave = 2 on token 6, 0 elsewhere.
    mask = torch.tensor([0, 1, 1, 1, 0, 0, 1], dtype=torch.bool)
    prox = torch.full((7,), -1.0)
    behave = prox - torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0])
    logp = prox.clone().requires_grad_(True)
    _, stats = ppo_loss_with(
        logp,
        prox,
        torch.ones(7),
        mask,
        behave_logprobs=behave,
        use_decoupled_loss=True,
        cu_seqlens=torch.tensor([0, 4, 7]),
        **kwargs,  # type: ignore[arg-type]
    )
    check_stat_names(stats)
    return stats


def _counts(stats: dict[str, torch.Tensor]) -> list[float]:
    names = ("n_total_tokens", "n_valid_tokens", "n_masked_tokens", "masked_token_ratio")
    return [float(stats[n]) for n in names]


def test_token_counts_follow_areal_ppo_actor_loss_fn() -> None:
    # AReaL 2.0 `ppo_actor_loss_fn` (areal/utils/functional/functional.py, cbff54d), on the
    # packed micro-batch `grpo_loss_fn` hands it (prompts in, no padding):
    #   n_total_tokens = stat_loss_mask.numel()          = 7
    #   n_valid_tokens = stat_loss_mask.count_nonzero()  = 4
    #   n_masked_tokens = 7 - 4 = 3 ; masked_token_ratio = 1 - 4 / max(7, 1) = 3/7
    # where stat_loss_mask is the mask before rejection sampling.
    plain = _count_case()
    assert _counts(plain) == pytest.approx([7.0, 4.0, 3.0, 3 / 7], abs=1e-7)
    # IcePop drops token 6 (π_prox/π_behave = e² = 7.39 > 5): the loss loses it, the
    # counts do not (rejection sampling narrows loss_mask after stat_loss_mask is taken);
    # the drop shows in rs_filtered_fraction = 1/4
    rs = _count_case(rejection_sampling=RejectionSamplingConfig(lower=0.5, upper=5.0))
    assert _counts(rs) == pytest.approx([7.0, 4.0, 3.0, 3 / 7], abs=1e-7)
    assert float(rs["rs_filtered_fraction"]) == pytest.approx(0.25)
    # M2PO runs before the loss function (`grpo_loss_fn` → `_apply_m2po_masking`): with
    # M2 = [0, 0, 0, 4], mean 1 >= 0.5, the largest goes, [0, 0, 0] has mean 0 < 0.5:
    # V = 3, n_masked_tokens = 4, masked_token_ratio = 1 - 3/7 = 4/7
    m2 = _count_case(m2_threshold=0.5)
    assert _counts(m2) == pytest.approx([7.0, 3.0, 4.0, 4 / 7], abs=1e-7)


def test_token_counts_of_a_padded_batch_need_its_attention_mask() -> None:
    # The same two sequences right-padded to [2, 4]: AReaL packs them (7 tokens), so the
    # attention mask gives N = 7; without it every one of the 8 positions counts.
    mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 0]], dtype=torch.bool)
    attention = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    prox = torch.full((2, 4), -1.0)
    args = (prox.clone().requires_grad_(True), prox, torch.ones(2, 4), mask)
    _, with_attention = ppo_loss_with(*args, attention_mask=attention)
    assert _counts(with_attention) == pytest.approx([7.0, 4.0, 3.0, 3 / 7], abs=1e-7)
    _, positions = ppo_loss_with(*args)
    assert _counts(positions) == pytest.approx([8.0, 4.0, 4.0, 0.5], abs=1e-7)
    short = attention.clone()
    short[0, 3] = False  # a loss token outside the attention mask
    with pytest.raises(ValueError, match="attention_mask is 0"):
        ppo_loss_with(*args, attention_mask=short)
    # nothing to count: 1 - 0 / max(0, 1) = 1, no division by zero
    empty = torch.zeros(1, 0, dtype=torch.bool)
    z = torch.zeros(1, 0)
    _, none = ppo_loss_with(z.clone().requires_grad_(True), z, z, empty)
    assert _counts(none) == [0.0, 0.0, 0.0, 1.0]
