"""A run's state from its files (services/trainer/lifecycle.py), and a trainer started on a
completed run: it exits 0 at once, says so, and trains nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from services.common.config.loader import load_config
from services.trainer import lifecycle
from services.trainer.paths import RunPaths
from tests.trainer.services import ROOT, write_config


def _cfg(root: Path, *overrides: str):
    return load_config(
        None,
        [f"cluster.fileroot={root}", "experiment_name=e", "trial_name=t", *overrides],
    )


def _checkpoint(paths: RunPaths, step: int, version: int) -> Path:
    path = paths.checkpoint_dir / f"step_{step:08d}"
    path.mkdir(parents=True)
    lifecycle.write_json_atomic(path / lifecycle.STATE_FILE, {"step": step, "version": version})
    return path


def test_completion_is_for_the_current_total_and_comes_from_the_record_or_checkpoint(
    tmp_path: Path,
) -> None:
    cfg = _cfg(tmp_path, "total_train_steps=6")
    paths = RunPaths.from_config(cfg)
    assert lifecycle.completed_run(cfg) is None  # nothing on disk
    _checkpoint(paths, 4, 4)
    assert lifecycle.completed_run(cfg) is None  # 4 of 6 steps: resumable, not complete
    _checkpoint(paths, 6, 7)  # the final checkpoint, but the record was never written
    done = lifecycle.completed_run(cfg)
    assert done is not None and (done["step"], done["version"]) == (6, 7)

    lifecycle.write_completion(paths, step=6, version=7, total_train_steps=6, checkpoint=None)
    record = json.loads((paths.checkpoint_dir / "completed.json").read_text())
    assert (record["state"], record["step"], record["total_train_steps"]) == ("completed", 6, 6)
    # The same directory with a longer run configured: training left, so not complete.
    assert lifecycle.completed_run(_cfg(tmp_path, "total_train_steps=10")) is None
    # `recover: disabled` trains from scratch whatever an earlier trainer left.
    assert (
        lifecycle.completed_run(_cfg(tmp_path, "total_train_steps=6", "trainer.recover=disabled"))
        is None
    )
    assert lifecycle.completed_run(_cfg(tmp_path, "total_train_steps=null")) is None


def test_run_state_completed_running_stopped_failed(tmp_path: Path) -> None:
    paths = RunPaths.from_config(_cfg(tmp_path))
    state = lifecycle.run_state(paths, 6, trainer_running=False)
    assert state["state"] == "not started"
    assert lifecycle.run_state(paths, 6, trainer_running=True)["state"] == "running"
    _checkpoint(paths, 2, 2)
    # A checkpoint but no trainer and no exit record: it was killed (kill -9, OOM).
    assert lifecycle.run_state(paths, 6, trainer_running=False)["state"] == "failed"
    lifecycle.write_exit(paths, code=0, reason="requested", step=3, version=3)
    stopped = lifecycle.run_state(paths, 6, trainer_running=False)
    assert (stopped["state"], stopped["step"], stopped["last_checkpoint_step"]) == ("stopped", 3, 2)
    lifecycle.write_exit(paths, code=1, reason="RuntimeError: boom", step=3, version=3)
    failed = lifecycle.run_state(paths, 6, trainer_running=False)
    assert failed["state"] == "failed" and failed["last_exit"]["reason"] == "RuntimeError: boom"
    # A running trainer (restarted after the failure) is what counts while it runs.
    assert lifecycle.run_state(paths, 6, trainer_running=True)["state"] == "running"
    lifecycle.write_completion(paths, step=6, version=6, total_train_steps=6, checkpoint=None)
    assert lifecycle.run_state(paths, 6, trainer_running=False)["state"] == "completed"
    assert lifecycle.run_state(paths, 8, trainer_running=False)["state"] == "failed"


def test_trainer_on_a_completed_run_exits_0_at_once(tmp_path: Path) -> None:
    # No buffer, no model on disk: a trainer that tried to train would fail (exit 1).
    cfg = _cfg(
        tmp_path,
        "total_train_steps=6",
        f"actor.path={tmp_path / 'no-such-model'}",
        "services.buffer.port=1",
    )
    paths = RunPaths.from_config(cfg)
    _checkpoint(paths, 6, 6)
    lifecycle.write_completion(paths, step=6, version=6, total_train_steps=6, checkpoint=None)
    config = write_config(cfg, tmp_path / "cfg.yaml")
    proc = subprocess.run(
        [sys.executable, "-m", "services.trainer", "--config", str(config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    lines = [x for x in out.splitlines() if "already completed" in x]
    assert len(lines) == 1 and "step 6" in lines[0], out[-3000:]
    assert not paths.metrics_jsonl.exists()
