"""Rank 0's report of one finished step: its line in `metrics.jsonl`, the experiment
tracker, the Prometheus metrics, the control state the status RPC shows, and a log line.

Apart from the loop because the loop decides *when* a step is reported (at once, or after
its background publication, see `background_publication.py`), and this module *what* the
report holds; the line itself is `step_records.step_record`'s.
"""

from __future__ import annotations

import logging
from typing import Any

from services.common.config import FlywheelConfig
from services.trainer.control import Control
from services.trainer.metrics import JsonlWriter, TrainerMetrics
from services.trainer.paths import RunPaths
from services.trainer.ppo import StepResult
from services.trainer.step_records import pending_record_path, step_record
from services.trainer.tracking import Tracker

log = logging.getLogger(__name__)


class StepReporter:
    """Writes every report of a step, on rank 0 only (the other ranks hold none)."""

    def __init__(
        self,
        cfg: FlywheelConfig,
        paths: RunPaths,
        control: Control,
        metrics: TrainerMetrics | None,
    ) -> None:
        self.paths = paths
        self.control = control
        self.metrics = metrics
        self.log_every_steps = cfg.trainer.log_every_steps
        self.jsonl = JsonlWriter(paths.metrics_jsonl)
        self.tracker = Tracker(cfg, paths.run_dir)

    def close(self) -> None:
        """Flush and close the experiment tracker's run."""
        self.tracker.close()

    def record(
        self,
        r: StepResult,
        phases: dict[str, float],
        ids: list[str],
        step_seconds: float,
        report: Any,
        *,
        step: int,
        version: int,
        wall_time: float | None = None,
    ) -> None:
        """The step's record (metrics.jsonl, tracking, Prometheus, control). `report` is the
        step's weight publication (`PublishReport`), None when nothing was published;
        `wall_time` the step's own when it is recorded after a background publication."""
        record = step_record(
            r, phases, ids, step_seconds, step=step, version=version, wall_time=wall_time
        )
        if report is not None:
            record["weight_broadcast_seconds"] = report.seconds
            record["replicas_updated"] = len(report.updated)
            record["replicas_failed"] = sorted(report.failed)
        self.jsonl.write(record)
        pending_record_path(self.paths.metrics_jsonl, step).unlink(missing_ok=True)
        self.tracker.log(record)
        if self.metrics is not None:
            self.metrics.observe_step(record)
            if report is not None:
                self.metrics.broadcast_seconds.labels(transport=report.transport).observe(
                    report.seconds
                )
                self.metrics.unhealthy.inc(len(report.failed))
        skipped = self.control.skipped_updates + r.skipped_updates
        unhealthy = self.control.unhealthy_replica_updates + (len(report.failed) if report else 0)
        self.control.update(skipped_updates=skipped, unhealthy_replica_updates=unhealthy)
        self.control.finish_step(
            step=step,
            version=version,
            stats={k: v for k, v in r.stats.items() if isinstance(v, float)}
            | {"loss": r.loss, "grad_norm": r.grad_norm, "lr": r.lr},
        )
        if step % self.log_every_steps == 0:
            log.info(
                "step",
                extra={
                    "step": step,
                    "version": version,
                    "loss": round(r.loss, 5),
                    "task_reward": r.stats.get("task_reward"),
                    "seconds": round(step_seconds, 3),
                },
            )
