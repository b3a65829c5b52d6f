"""Proximal log-probabilities: versions convention, methods, metrics, guards."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from services.trainer.algorithms.prox import (
    compute_prox_logp,
    interpolation_alpha,
    needs_recompute,
)
from services.trainer.algorithms.stats import STATS, check_stat_names


def test_alpha_hand_computed() -> None:
    # current_version v = 5 (π_prox = W_5), π_θ at v_θ = 6
    # v_b = -1 (prompt) -> 0 ; v_b = 5 -> (5-5)/(6-5) = 0 ; v_b = 4 -> 1/2 ; v_b = 3 -> 2/3
    alpha = interpolation_alpha(torch.tensor([-1, 5, 4, 3]), current_version=5)
    assert_close(alpha, torch.tensor([0.0, 0.0, 0.5, 2 / 3]), rtol=0, atol=1e-6)
    # explicit v_θ = v + j/n: first minibatch (j = 0) gives α = 1 for stale tokens (exact)
    alpha = interpolation_alpha(torch.tensor([4, 5]), current_version=5, theta_version=5.0)
    assert alpha.tolist() == [1.0, 0.0]
    # a version newer than v_θ cannot happen in a correct run; α is clamped, not negative
    alpha = interpolation_alpha(torch.tensor([9]), current_version=5)
    assert alpha.tolist() == [0.0]


def test_versions_convention_makes_loglinear_exact_for_log_linear_policies() -> None:
    # A policy family whose token log-probabilities move linearly with the version:
    # log π_v(t) = a_t + b_t * v. At step v = 7, π_prox = W_7, π_θ is placed at v_θ = 8.
    a = torch.tensor([-2.0, -1.0, -3.0, -0.5])
    b = torch.tensor([0.05, -0.10, 0.02, -0.01])
    v = 7
    versions = torch.tensor([7, 6, 4, 2])

    def logp(ver: torch.Tensor | float) -> torch.Tensor:
        return a + b * ver

    res = compute_prox_logp(
        "loglinear",
        theta_logprobs=logp(v + 1),
        behave_logprobs=logp(versions.float()),
        versions=versions,
        current_version=v,
    )
    # exact: log π_prox = a + 7 b for every token, whatever its behaviour version
    assert_close(res.prox_logprobs, logp(v), rtol=0, atol=1e-6)
    # the AReaL convention (v_prox = current - 1, v_θ = current) with the same inputs is
    # off by one version for tokens that are one version stale or more
    shifted = interpolation_alpha(versions, current_version=v - 1, theta_version=float(v))
    wrong = logp(versions.float()) + shifted * (logp(v + 1) - logp(versions.float()))
    assert (wrong - logp(v))[1:].abs().min() > 1e-3


def _real_policy_versions(n_versions: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A real tiny softmax policy trained by SGD; log-probs of fixed tokens per version."""
    g = torch.Generator().manual_seed(3)
    model = torch.nn.Linear(6, 10)
    with torch.no_grad():
        model.weight.copy_(torch.randn(10, 6, generator=g) * 0.5)
        model.bias.zero_()
    states = torch.randn(32, 6, generator=g)
    tokens = torch.randint(0, 10, (32,), generator=g)
    target = torch.randint(0, 10, (32,), generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for _ in range(n_versions):
        with torch.no_grad():
            out.append(torch.log_softmax(model(states), -1).gather(1, tokens[:, None])[:, 0])
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(states), target).backward()
        opt.step()
    return out, tokens


def test_loglinear_tracks_a_real_policy_better_than_the_rollout_baseline() -> None:
    logps, _ = _real_policy_versions(8)  # W_0 .. W_7
    v = 6  # trainer holds W_6; π_θ's end point is W_7
    versions = torch.tensor([3, 4, 5, 6] * 8)
    behave = torch.stack([logps[int(x)][i] for i, x in enumerate(versions)])
    res = compute_prox_logp(
        "metrics",
        theta_logprobs=logps[v + 1],
        behave_logprobs=behave,
        versions=versions,
        current_version=v,
        recomputed_logprobs=logps[v],
    )
    s = res.stats
    assert_close(res.prox_logprobs, logps[v], rtol=0, atol=0)
    # the rollout baseline error is the staleness itself; the approximations beat it
    assert s["prox_approx/loglinear/logp_abs_error"] < 0.2 * s["prox_approx/rollout/logp_abs_error"]
    assert s["prox_approx/linear/logp_abs_error"] < 0.5 * s["prox_approx/rollout/logp_abs_error"]
    check_stat_names(s)
    expected = {
        f"prox_approx/{m}/{q}_{k}"
        for m in ("loglinear", "linear", "rollout")
        for q in ("logp", "behave_imp_weight", "importance_weight")
        for k in ("abs_error", "rel_error", "sq_error")
    }
    assert expected <= set(s) and expected <= set(STATS)


def test_linear_and_rollout_hand_computed() -> None:
    # α = 1/2 (v=5, v_b=4, v_θ=6): p = 0.5*0.2 + 0.5*0.6 = 0.4
    res = compute_prox_logp(
        "linear",
        theta_logprobs=torch.log(torch.tensor([0.6])),
        behave_logprobs=torch.log(torch.tensor([0.2])),
        versions=torch.tensor([4]),
        current_version=5,
    )
    assert_close(res.prox_logprobs, torch.log(torch.tensor([0.4])), rtol=0, atol=1e-6)
    # metrics: rollout error |log 0.2 - log 0.4| = ln 2 ; loglinear log(sqrt(0.12)) vs log 0.4
    res = compute_prox_logp(
        "metrics",
        theta_logprobs=torch.log(torch.tensor([0.6])),
        behave_logprobs=torch.log(torch.tensor([0.2])),
        versions=torch.tensor([4]),
        current_version=5,
        recomputed_logprobs=torch.log(torch.tensor([0.4])),
    )
    assert_close(
        res.stats["prox_approx/rollout/logp_abs_error"],
        torch.tensor(math.log(2)),
        rtol=0,
        atol=1e-6,
    )
    ll = 0.5 * (math.log(0.2) + math.log(0.6))
    assert_close(
        res.stats["prox_approx/loglinear/logp_abs_error"],
        torch.tensor(abs(ll - math.log(0.4))),
        rtol=0,
        atol=1e-6,
    )
    assert_close(
        res.stats["prox_approx/linear/logp_sq_error"], torch.tensor(0.0), rtol=0, atol=1e-10
    )
    # behaviour weight of the rollout approximation is 1, the truth is 0.4/0.2 = 2 -> |1-2| = 1
    assert_close(
        res.stats["prox_approx/rollout/behave_imp_weight_abs_error"],
        torch.tensor(1.0),
        rtol=0,
        atol=1e-6,
    )


def test_methods_guards_and_forward_pass_needs() -> None:
    theta = torch.tensor([-1.0, -2.0])
    assert needs_recompute("recompute") and needs_recompute("metrics")
    assert not needs_recompute("loglinear") and not needs_recompute("reuse_train_logp")
    with pytest.raises(ValueError, match="valid: recompute, loglinear, linear, metrics"):
        needs_recompute("approx")
    res = compute_prox_logp("reuse_train_logp", theta_logprobs=theta.requires_grad_(True))
    assert not res.prox_logprobs.requires_grad and res.prox_logprobs.tolist() == [-1.0, -2.0]
    with pytest.raises(ValueError, match="needs ppo_n_minibatches=1"):
        compute_prox_logp("reuse_train_logp", theta_logprobs=theta, ppo_n_minibatches=2)
    with pytest.raises(ValueError, match="needs recomputed_logprobs"):
        compute_prox_logp("recompute", theta_logprobs=theta)
    with pytest.raises(ValueError, match="needs behave_logprobs, versions and current_version"):
        compute_prox_logp("loglinear", theta_logprobs=theta)
    with pytest.raises(ValueError, match="behave_logprobs has 1 NaN/Inf"):
        compute_prox_logp(
            "loglinear",
            theta_logprobs=theta,
            behave_logprobs=torch.tensor([float("nan"), -1.0]),
            versions=torch.tensor([0, 0]),
            current_version=1,
        )
    # NaN on a prompt token (version -1) is ignored: the loss never reads it
    res = compute_prox_logp(
        "loglinear",
        theta_logprobs=theta,
        behave_logprobs=torch.tensor([float("nan"), -1.5]),
        versions=torch.tensor([-1, 0]),
        current_version=1,
    )
    assert math.isfinite(res.prox_logprobs[1].item())
