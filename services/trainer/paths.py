"""Where a trainer run keeps its files; its own module so the launcher can find them
without importing the trainer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.common.config import FlywheelConfig


@dataclass
class RunPaths:
    run_dir: Path
    checkpoint_dir: Path
    weight_dir: Path
    metrics_jsonl: Path
    # The trainer's Prometheus series as it exits (text exposition format), for whoever
    # missed the last scrape of a short run: the launcher, a node_exporter textfile collector.
    metrics_textfile: Path

    @classmethod
    def from_config(cls, cfg: FlywheelConfig) -> RunPaths:
        run_dir = Path(cfg.cluster.fileroot) / cfg.experiment_name / cfg.trial_name
        t = cfg.trainer
        return cls(
            run_dir=run_dir,
            checkpoint_dir=Path(t.checkpoint_dir) if t.checkpoint_dir else run_dir / "checkpoints",
            weight_dir=Path(t.weight_dir) if t.weight_dir else run_dir / "weights",
            metrics_jsonl=Path(t.metrics_jsonl) if t.metrics_jsonl else run_dir / "metrics.jsonl",
            metrics_textfile=run_dir / "trainer_metrics.prom",
        )
