"""The `flywheel` console script as a user runs it (subprocess), plus its dispatch."""

from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from services import cli
from tests.fresh_python import run_fresh

ROOT = Path(__file__).resolve().parents[1]
FLYWHEEL = ROOT / ".venv" / "bin" / "flywheel"


def flywheel(*args: str) -> subprocess.CompletedProcess[str]:
    exe = [str(FLYWHEEL)] if FLYWHEEL.exists() else [sys.executable, "-m", "services.cli"]
    return subprocess.run(
        [*exe, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )


def test_dry_run_prints_the_resolved_config() -> None:
    out = flywheel(
        "run", "--config", "examples/grpo.yaml", "actor.adv_norm.std_level=null", "--dry-run"
    )
    assert out.returncode == 0, out.stderr
    assert (
        "  adv_norm:\n    mean_level: batch\n    mean_leave1out: false\n    std_level: null\n"
        in out.stdout
    )
    printed = yaml.safe_load(out.stdout)
    assert printed["actor"]["adv_norm"]["std_level"] is None
    assert printed["actor"]["group_size"] == 4  # ${gconfig.n_samples} resolved


def test_overrides_may_come_before_the_options() -> None:
    out = flywheel("run", "actor.eps_clip=0.3", "--dry-run", "--config", "examples/grpo.yaml")
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["actor"]["eps_clip"] == 0.3


def test_unknown_key_exits_2_naming_it() -> None:
    out = flywheel("run", "--config", "examples/grpo.yaml", "actor.eps_clp=0.3", "--dry-run")
    assert out.returncode == 2
    assert out.stdout == ""
    assert "actor.eps_clp" in out.stderr
    assert "did you mean 'actor.eps_clip'" in out.stderr


def test_bad_value_exits_2_naming_field_and_value() -> None:
    out = flywheel(
        "run", "--config", "examples/grpo.yaml", "actor.rejection_sampling.upper=0.5", "--dry-run"
    )
    assert out.returncode == 2
    assert "actor.rejection_sampling.upper = 0.5" in out.stderr
    assert "> 1" in out.stderr


def test_missing_config_file_exits_2() -> None:
    out = flywheel("run", "--config", "examples/does-not-exist.yaml", "--dry-run")
    assert out.returncode == 2
    assert "does-not-exist.yaml" in out.stderr


def test_unknown_option_is_a_usage_error() -> None:
    out = flywheel("run", "--config", "examples/grpo.yaml", "--dryrun")
    assert out.returncode == 2
    assert "--dryrun" in out.stderr


def _fake_launcher(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Stand-in for services.launcher.main that records calls (dispatch logic only)."""
    calls: list[tuple] = []
    fake = types.ModuleType("services.launcher.main")
    fake.run = lambda cfg, path, overrides: calls.append(("run", cfg, path, overrides)) or 0
    fake.eval_main = lambda argv: calls.append(("eval", argv)) or 3
    fake.status_main = lambda argv: calls.append(("status", argv)) or 0
    monkeypatch.setitem(sys.modules, "services.launcher.main", fake)
    return calls


def test_run_dispatches_the_validated_config(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_launcher(monkeypatch)
    code = cli.main(["run", "--config", "examples/grpo.yaml", "seed=5"])
    assert code == 0
    ((name, cfg, path, overrides),) = calls
    assert name == "run" and path == "examples/grpo.yaml" and overrides == ["seed=5"]
    assert cfg.seed == 5


def test_eval_and_status_get_their_own_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_launcher(monkeypatch)
    assert cli.main(["eval", "--config", "x.yaml", "--checkpoint", "/ck"]) == 3
    assert cli.main(["status", "/tmp/run"]) == 0
    assert calls == [
        ("eval", ["--config", "x.yaml", "--checkpoint", "/ck"]),
        ("status", ["/tmp/run"]),
    ]


def test_invalid_config_never_reaches_the_launcher(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = _fake_launcher(monkeypatch)
    assert cli.main(["run", "--config", "examples/grpo.yaml", "actor.c_clip=0.5"]) == 2
    assert calls == []
    assert "actor.c_clip = 0.5" in capsys.readouterr().err


def _dead_run_dir(tmp_path: Path) -> Path:
    """A run directory whose services.json names ports nothing listens on (port 1)."""
    import json

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dead = {"grpc": "127.0.0.1:1", "metrics": "http://127.0.0.1:1/metrics"}
    info = {"buffer": dead, "reward": dead, "trainer": dead, "rollout": [dead]}
    (run_dir / "services.json").write_text(json.dumps(info))
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"total_train_steps": 6}))
    return run_dir


def _status(run_dir: Path) -> tuple[int, dict]:
    import json

    proc = flywheel("status", str(run_dir))
    assert proc.stdout.startswith("{"), proc.stderr[-2000:]
    return proc.returncode, json.loads(proc.stdout)["run"]


def test_status_reports_a_completed_run_as_completed(tmp_path: Path) -> None:
    from services.trainer import lifecycle
    from services.trainer.paths import RunPaths

    run_dir = _dead_run_dir(tmp_path)
    paths = RunPaths(
        run_dir, run_dir / "checkpoints", run_dir / "w", run_dir / "metrics.jsonl", run_dir / "p"
    )
    ckpt = run_dir / "checkpoints" / "step_00000004"
    ckpt.mkdir(parents=True)
    (ckpt / lifecycle.STATE_FILE).write_text('{"step": 4, "version": 4}')
    # Services gone, a checkpoint, no exit record: the trainer was killed.
    code, run = _status(run_dir)
    assert (code, run["state"], run["last_checkpoint_step"]) == (1, "failed", 4)
    lifecycle.write_exit(paths, code=0, reason="requested", step=4, version=4)
    code, run = _status(run_dir)
    assert (code, run["state"]) == (1, "stopped")
    lifecycle.write_completion(paths, step=6, version=6, total_train_steps=6, checkpoint=None)
    code, run = _status(run_dir)
    assert (code, run["state"], run["step"]) == (0, "completed", 6)
    # Without services.json (the launcher's run is long over, or compose/Helm): the same.
    (run_dir / "services.json").unlink()
    code, run = _status(run_dir)
    assert (code, run["state"]) == (0, "completed")


@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        (["reward.fn=no_such_pkg.rewards:fn"], "reward.fn", "cannot import module 'no_such_pkg"),
        (["reward.fn=gsm8kk"], "reward.fn", "not a registered reward function"),
        (
            ["+reward.functions={mine: examples.extending.reward:nope}"],
            "reward.fn",
            "has no attribute 'nope'",
        ),
        (
            ["rollout.workflow=examples.extending.workflow.LengthPenalty"],
            "rollout.workflow",
            "has no attribute 'LengthPenalty'",
        ),
        (
            ["rollout.workflow=examples.extending.reward.last_number_reward"],
            "rollout.workflow",
            "arun_episode",
        ),
        (["buffer.filter=examples.extending.group_filter:nope"], "buffer.filter", "'nope'"),
        (["actor.should_accept_fn=dapo"], "actor.should_accept_fn", "dapo_equal_rewards"),
        (
            ["actor.gae_lambda=examples.extending.gae_lambda:by_lenght"],
            "actor.gae_lambda",
            "has no attribute 'by_lenght'",
        ),
        (
            [
                "actor.gae_lambda=examples.extending.gae_lambda:by_length",
                "actor.gae_lambda_kwargs={treshold: 2}",
            ],
            "actor.gae_lambda",
            "treshold",
        ),
        (
            ["actor.surrogate=examples.extending.surrogates:unclipped"],
            "actor.surrogate",
            "cannot import module 'examples.extending.surrogates'",
        ),
        (
            ["actor.surrogate=examples.extending.reward:last_number_reward"],
            "actor.surrogate",
            "does not fit the signature",
        ),
    ],
)
def test_dry_run_imports_each_dotted_path_and_names_the_key(
    overrides: list[str], key: str, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["run", "--config", "examples/grpo.yaml", "--dry-run", *overrides])
    out = capsys.readouterr()
    assert code == cli.EXIT_BAD_CONFIG and out.out == ""
    line = next(x for x in out.err.splitlines() if x.strip().startswith(f"{key} = "))
    assert words in line, out.err


def test_dry_run_of_a_plain_config_imports_no_torch() -> None:
    code = (
        "import sys; from services import cli; "
        "rc = cli.main(['run', '--config', 'examples/grpo.yaml', '--dry-run']); "
        "assert rc == 0, rc; assert 'torch' not in sys.modules, 'torch was imported'"
    )
    out = run_fresh(code)
    assert out.returncode == 0, out.stderr


def test_help_lists_every_subcommand() -> None:
    out = flywheel("--help")
    assert out.returncode == 0
    for name in ("run", "eval", "status", "doctor", "sft"):
        assert re.search(rf"^\s+{name}\s", out.stdout, flags=re.M), (name, out.stdout)
