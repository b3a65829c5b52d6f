"""Every algorithm preset is the named combination it claims to be, and runs.

Each preset in examples/ is loaded with the real loader, mapped onto the algorithm core
by the config views, and driven through advantages + actor (+ critic) loss + backward
on a random batch; `flywheel run --dry-run` accepts it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.cli import main as flywheel_main
from services.common.config import load_config
from services.common.config.views import ActorLossView, AdvantageView, CriticLossView
from services.core.filters import resolve_should_accept
from services.trainer.algorithms import (
    compute_advantages,
    compute_prox_logp,
    critic_loss,
    ppo_actor_loss,
)
from services.trainer.algorithms.prox import needs_recompute
from services.trainer.algorithms.stats import check_stat_names

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
MINE = [
    "ppo",
    "drgrpo",
    "liteppo",
    "rloo",
    "gspo",
    "dapo_dynamic_bs",
    "sapo",
    "cispo",
    "icepop",
    "kpop",
    "m2po",
    "prox_approx",
    "prox_approx_eval",
]
ALL = [*MINE, "grpo"]


def _norm(n):  # type: ignore[no-untyped-def]
    return None if n is None else (n.mean_level, n.std_level, n.mean_leave1out)


def test_presets_are_the_advertised_combinations() -> None:
    c = {name: load_config(EXAMPLES / f"{name}.yaml") for name in ALL}
    a = {name: cfg.actor for name, cfg in c.items()}
    # PPO: critic + reference + KL shaping + GAE λ < 1
    assert c["ppo"].critic is not None and c["ppo"].ref is not None
    assert a["ppo"].kl_ctl > 0 and a["ppo"].gae_lambda == 0.95
    assert all(c[n].critic is None for n in ALL if n != "ppo")
    # the norm matrix (AReaL's table)
    assert _norm(a["grpo"].reward_norm) == ("group", "group", False)
    assert _norm(a["drgrpo"].adv_norm) == ("group", None, False)
    assert a["drgrpo"].loss_agg_mode == "seq-mean-token-sum-norm"
    assert _norm(a["liteppo"].adv_norm) == ("group", "batch", False)
    assert _norm(a["rloo"].adv_norm) == ("group", None, True)
    # surrogates and importance-sampling level
    view = {name: ActorLossView.of(actor) for name, actor in a.items()}
    assert view["gspo"].importance_sampling_level == "sequence"
    assert view["sapo"].surrogate == "sapo" and not view["sapo"].use_decoupled_loss
    assert view["cispo"].surrogate == "cispo" and view["cispo"].eps_clip_higher == 4.0
    assert view["grpo"].surrogate == "clip"
    # DAPO
    dapo = a["dapo_dynamic_bs"]
    assert dapo.eps_clip_higher == 0.28 and dapo.overlong_reward_penalty and dapo.dynamic_sampling
    for actor, accepts_equal_rewards in ((dapo, False), (a["grpo"], True)):
        accept = resolve_should_accept(
            actor.should_accept_fn, dynamic_sampling=actor.dynamic_sampling
        )
        assert accept([1.0, 1.0]) is accepts_equal_rewards
    # off-policy corrections
    assert a["icepop"].rejection_sampling.metric == "ratio"
    assert (a["icepop"].rejection_sampling.lower, a["icepop"].rejection_sampling.upper) == (
        0.5,
        5.0,
    )
    assert a["kpop"].rejection_sampling.metric == "binary_kl"
    assert a["m2po"].m2_threshold == 0.04
    # proximal policy methods
    assert a["prox_approx"].prox_logp_method == "loglinear"
    assert not needs_recompute(a["prox_approx"].prox_logp_method)
    assert a["prox_approx_eval"].prox_logp_method == "metrics"


def _batch(gen: torch.Generator) -> dict[str, torch.Tensor]:
    b, t, prompt = 8, 20, 4
    lengths = torch.randint(prompt + 3, t + 1, (b,), generator=gen)
    pos = torch.arange(t).unsqueeze(0)
    attn = pos < lengths.unsqueeze(1)
    mask = attn & (pos >= prompt)
    behave = torch.where(mask, -torch.rand(b, t, generator=gen) * 3, 0.0)
    return {
        "mask": mask,
        "attn": attn.long(),
        "behave": behave,
        "prox": behave + 0.05 * torch.randn(b, t, generator=gen),
        "ref": behave + 0.05 * torch.randn(b, t, generator=gen),
        "theta": behave + 0.1 * torch.randn(b, t, generator=gen),
        "values": torch.randn(b, t, generator=gen),
        "versions": torch.where(mask, torch.randint(0, 3, (b, t), generator=gen), -1),
        "rewards": torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0]),
        "no_eos": lengths == t,
        "group_ids": torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]),
    }


@pytest.mark.parametrize("name", ALL)
def test_preset_runs_through_the_algorithm_core(name: str, gen: torch.Generator) -> None:
    cfg = load_config(EXAMPLES / f"{name}.yaml")
    d = _batch(gen)
    adv = compute_advantages(
        AdvantageView.of(cfg.actor),
        rewards=d["rewards"],
        loss_mask=d["mask"],
        no_eos=d["no_eos"],
        logprobs=d["prox"],
        ref_logprobs=d["ref"] if cfg.actor.kl_ctl > 0 else None,
        values=d["values"] if cfg.critic is not None else None,
        bootstrap_values=torch.zeros(8) if cfg.critic is not None else None,
        group_ids=d["group_ids"],
        attention_mask=d["attn"],
    )
    theta = d["theta"].clone().requires_grad_(True)
    current_version = 3
    if cfg.actor.use_decoupled_loss:
        prox = compute_prox_logp(
            cfg.actor.prox_logp_method,
            ppo_n_minibatches=cfg.actor.ppo_n_minibatches,
            theta_logprobs=theta,
            behave_logprobs=d["behave"],
            versions=d["versions"],
            current_version=current_version,
            loss_mask=adv.loss_mask,
            recomputed_logprobs=d["prox"],
        )
        proximal, prox_stats = prox.prox_logprobs, prox.stats
    else:
        proximal, prox_stats = d["prox"], {}
    loss, stats = ppo_actor_loss(
        theta,
        proximal,
        adv.advantages,
        adv.loss_mask,
        ActorLossView.of(cfg.actor),
        behave_logprobs=d["behave"],
        versions=d["versions"],
        current_version=current_version,
        normalizer=float(adv.loss_mask.sum()),
    )
    loss.backward()
    assert torch.isfinite(loss) and theta.grad is not None
    assert bool(torch.isfinite(theta.grad).all()) and theta.grad.abs().sum() > 0
    for s in (adv.stats, stats, prox_stats):
        check_stat_names(s)
    if cfg.actor.prox_logp_method == "metrics":
        assert "prox_approx/loglinear/logp_abs_error" in prox_stats
    if cfg.critic is not None:
        values = d["values"].clone().requires_grad_(True)
        critic_view = CriticLossView.of(cfg.critic, cfg.actor)
        closs, cstats = critic_loss(values, d["values"], adv.returns, adv.loss_mask, critic_view)
        closs.backward()
        assert torch.isfinite(closs) and values.grad is not None
        check_stat_names(cstats)


def test_cli_dry_run_accepts_every_preset(capsys: pytest.CaptureFixture[str]) -> None:
    for name in MINE:
        assert flywheel_main(["run", "--config", str(EXAMPLES / f"{name}.yaml"), "--dry-run"]) == 0
        out = capsys.readouterr().out
        assert f"experiment_name: {name.replace('_', '-')}" in out


def test_installed_cli_dry_run() -> None:
    # The console script a user runs, once (each start costs an interpreter).
    exe = Path(sys.executable).with_name("flywheel")
    out = subprocess.run(
        [str(exe), "run", "--config", str(EXAMPLES / "kpop.yaml"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "metric: binary_kl" in out.stdout
