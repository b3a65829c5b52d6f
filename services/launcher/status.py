"""The run-level part of `flywheel status`: completed, running, stopped or failed, read from
the trainer's records in the run directory (see `services/trainer/lifecycle.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.common.config import FlywheelConfig, load_config
from services.trainer import lifecycle
from services.trainer.paths import RunPaths


def _config(run_dir: Path, config: str | None, overrides: list[str]) -> FlywheelConfig | None:
    """The config the run was started with: the launcher's resolved copy in the run
    directory, else the one given on the command line."""
    resolved = run_dir / "config.yaml"
    if resolved.is_file():
        return load_config(str(resolved), [])
    if config:
        return load_config(config, overrides)
    return None


def run_paths(run_dir: Path, cfg: FlywheelConfig | None) -> RunPaths:
    """The trainer's files of the run in `run_dir` (the config may move checkpoints)."""
    t = cfg.trainer if cfg is not None else None
    return RunPaths(
        run_dir=run_dir,
        checkpoint_dir=Path(t.checkpoint_dir)
        if t and t.checkpoint_dir
        else run_dir / "checkpoints",
        weight_dir=Path(t.weight_dir) if t and t.weight_dir else run_dir / "weights",
        metrics_jsonl=Path(t.metrics_jsonl) if t and t.metrics_jsonl else run_dir / "metrics.jsonl",
        metrics_textfile=run_dir / "trainer_metrics.prom",
    )


def run_summary(
    run_dir: Path, config: str | None, overrides: list[str], *, trainer_running: bool
) -> dict[str, Any]:
    cfg = _config(run_dir, config, overrides)
    total = cfg.total_train_steps if cfg is not None else None
    return lifecycle.run_state(run_paths(run_dir, cfg), total, trainer_running=trainer_running)
