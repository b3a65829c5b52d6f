"""Check mode of the entry modules (`python -m services.X --check`): exit 0 when the
service would start, 2 with the reason when it would exit at start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.common.preflight import PreflightError, check_bindable

ROOT = Path(__file__).resolve().parents[2]


def check(service: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", f"services.{service}", "--check", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_reward_starts_with_no_config_at_all() -> None:
    """The embedded defaults are a valid config (before: exit 2 on actor.kl_ctl = 0.1
    without a reference model)."""
    result = check("reward")
    assert result.returncode == 0, result.stderr
    assert "reward: check passed" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("service", "args", "reason"),
    [
        ("rollout", (), "actor.path is empty"),
        ("trainer", (), "actor.path is empty"),
        ("trainer", ("--nnodes", "2", "actor.path=/m", "trainer.n_ranks=3"), "trainer.n_ranks=3"),
        ("rollout", ("--replica-index", "2", "actor.path=/m"), "rollout.n_replicas=1"),
        ("reward", ("reward.fn=gsm9k",), "gsm9k"),
        # A KL penalty without `ref` stops the trainer; the reward service does not read it
        # (tests/reward/test_main.py).
        ("trainer", ("actor.path=/m", "actor.kl_ctl=0.1"), "actor.kl_ctl"),
        # The default schedule (a warm-up proportion) has no length without total_train_steps:
        # PPOTrainer's schedule_steps raises at start (services/trainer/ppo.py).
        ("trainer", ("actor.path=/m",), "needs the schedule length"),
        ("buffer", ("services.buffer.host=buffer.flywheel.svc.cluster.local",), "resolve"),
    ],
)
def test_a_service_that_would_exit_at_start_fails_its_check(
    service: str, args: tuple[str, ...], reason: str
) -> None:
    result = check(service, *args)
    assert result.returncode == 2, result.stdout
    assert reason in result.stderr, result.stderr


@pytest.mark.slow
def test_trainer_and_rollout_pass_with_a_model_and_data(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    common = (f"actor.path={tmp_path}", f"train_dataset.path={data}")
    assert check("trainer", *common, "total_train_steps=5").returncode == 0
    assert check("rollout", *common).returncode == 0
    assert check("buffer", "buffer.redis_url=redis://127.0.0.1:6379/0").returncode == 0


def test_the_trainer_check_builds_its_optimizer_and_lr_schedule(capsys) -> None:
    """What PPOTrainer builds at start, without the model: the schedule spans
    total_train_steps x ppo_n_minibatches optimizer steps (`schedule_steps` in
    services/trainer/ppo.py): 10 x 2 = 20; the critic gets its own."""
    from services.trainer.__main__ import main

    base = ["--check", "actor.path=/m"]
    assert main(base) == 2
    assert "needs the schedule length: set total_train_steps" in capsys.readouterr().err
    assert main([*base, "total_train_steps=10", "actor.ppo_n_minibatches=2"]) == 0
    assert "actor constant lr over 20 optimizer steps" in capsys.readouterr().out
    bad = [*base, "total_train_steps=10", "actor.optimizer.lr_scheduler_type=cosine"]
    assert main([*bad, "trainer.lr_schedule_steps=3", "actor.ppo_n_minibatches=1"]) == 0
    assert "actor cosine lr over 3 optimizer steps" in capsys.readouterr().out


def test_the_rollout_check_resolves_its_workflow(capsys) -> None:
    """A workflow name the loop cannot load (RolloutService._build_loop, `load_workflow`)
    stops the replica at start: the check resolves it (eval-only replicas run none)."""
    from services.rollout.__main__ import main

    base = ["--check", "actor.path=/m", "train_dataset.path=/d.jsonl"]
    assert main([*base, "rollout.workflow=rlvrx"]) == 2
    assert "rollout.workflow='rlvrx' is unknown" in capsys.readouterr().err
    assert main([*base, "rollout.workflow=rlvrx", "--eval-only"]) == 0
    assert main(base) == 0


def test_bindable_addresses() -> None:
    check_bindable("x", "0.0.0.0", (50051, 0))
    check_bindable("x", "127.0.0.1", (0,))
    with pytest.raises(PreflightError, match="does not resolve"):
        check_bindable("x", "no-such-host.invalid", (1,))
    with pytest.raises(PreflightError, match="not an address of this machine"):
        check_bindable("x", "192.0.2.1", (1,))  # TEST-NET-1: never a local address
