"""Rank 0's report of one finished step (services/trainer/step_report.py): the line in
`metrics.jsonl` (the same dict `step_records.step_record` builds, plus the publication's
numbers), the pending copy gone, the Prometheus series and the control state moved on.
The Prometheus text is read back with `prometheus_client`'s own parser.
"""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.common.config import load_config
from services.trainer.control import Control
from services.trainer.metrics import TrainerMetrics
from services.trainer.paths import RunPaths
from services.trainer.ppo import StepResult
from services.trainer.step_records import pending_record_path, step_record
from services.trainer.step_report import StepReporter
from services.trainer.weight_sync import PublishReport


def _result(skipped: int) -> StepResult:
    return StepResult(
        version=3,
        loss=0.125,
        grad_norm=0.5,
        lr=1e-3,
        stats={"task_reward": 0.75, "importance_weight": 1.0},
        n_seqs=4,
        n_tokens=64,
        skipped_updates=skipped,
        prox_forwards=0,
    )


def _samples(metrics: TrainerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_published_step_is_reported_everywhere_once(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [f"cluster.fileroot={tmp_path}", "experiment_name=e", "trial_name=t", "trainer.device=cpu"],
    )
    paths = RunPaths.from_config(cfg)
    paths.run_dir.mkdir(parents=True)
    control = Control(total_train_steps=10, world_size=1)
    metrics = TrainerMetrics()
    reporter = StepReporter(cfg, paths, control, metrics)
    pending = pending_record_path(paths.metrics_jsonl, 3)
    pending.parent.mkdir(parents=True, exist_ok=True)
    pending.write_text("{}")  # the copy written before the step's checkpoint
    report = PublishReport(3, "disk", 0.5, updated=["r0"], failed={"r1": "checksum"})
    result = _result(skipped=1)
    phases = {"train": 1.0}
    ids = ["g1", "g2"]
    try:
        reporter.record(result, phases, ids, 2.0, report, step=3, version=3, wall_time=1e9)
        reporter.record(_result(skipped=2), phases, ["g3"], 2.0, None, step=4, version=4)
    finally:
        reporter.close()

    first, second = (json.loads(x) for x in paths.metrics_jsonl.read_text().splitlines())
    expected = step_record(result, phases, ids, 2.0, step=3, version=3, wall_time=1e9)
    assert first == {
        **expected,
        "weight_broadcast_seconds": 0.5,
        "replicas_updated": 1,
        "replicas_failed": ["r1"],
    }
    assert second["step"] == 4 and "weight_broadcast_seconds" not in second
    assert not pending.exists()

    snap = control.snapshot()
    assert (snap["step"], snap["version"]) == (4, 4)
    assert snap["skipped_updates"] == 1 + 2  # accumulated over both steps
    assert snap["unhealthy_replica_updates"] == 1  # r1, once
    assert snap["last_stats"]["loss"] == 0.125 and snap["last_stats"]["task_reward"] == 0.75

    s = _samples(metrics)
    assert s[("flywheel_trainer_steps_total", ())] == 2
    assert s[("flywheel_trainer_unhealthy_replicas_total", ())] == 1
    broadcast = ("flywheel_trainer_weight_broadcast_seconds_count", (("transport", "disk"),))
    assert s[broadcast] == 1
