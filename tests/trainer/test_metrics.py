"""The trainer's Prometheus instruments and the metrics.jsonl writer."""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client import generate_latest

from services.trainer.metrics import JsonlWriter, TrainerMetrics


def test_observe_step_exports_named_and_other_stats() -> None:
    m = TrainerMetrics()
    record = {
        "step": 3,
        "version": 3,
        "loss": -0.25,
        "grad_norm": 0.5,
        "lr": 1e-3,
        "step_seconds": 0.4,
        "tokens": 100,
        "samples": 8,
        "tokens_per_second": 250.0,
        "skipped_updates": 1,
        "prox_forwards": 2,
        "phase_seconds": {"train": 0.3, "prox": 0.1},
        "staleness_per_seq": [0, 1, 1, 2],
        "stats": {"importance_weight/avg": 1.0, "seq_len": 12.5, "prox_alpha": 0.25},
    }
    m.observe_step(record)
    text = generate_latest(m.registry).decode()
    for line in (
        "flywheel_trainer_version 3.0",
        "flywheel_trainer_steps_total 1.0",
        "flywheel_trainer_importance_weight 1.0",
        "flywheel_trainer_seq_len_tokens 12.5",
        'flywheel_trainer_stat{name="prox_alpha"} 0.25',
        "flywheel_trainer_loss -0.25",
        "flywheel_trainer_skipped_updates_total 1.0",
        "flywheel_trainer_prox_forwards_total 2.0",
        "flywheel_trainer_trained_tokens_total 100.0",
        "flywheel_trainer_tokens_per_second 250.0",
        # staleness 0, 1, 1, 2: three sequences are <= 1 version stale, all four <= 2
        'flywheel_trainer_staleness_versions_bucket{le="1.0"} 3.0',
        'flywheel_trainer_staleness_versions_bucket{le="2.0"} 4.0',
        'flywheel_trainer_phase_seconds_count{phase="prox"} 1.0',
    ):
        assert line in text, line


def test_jsonl_appends_one_line_per_record(tmp_path: Path) -> None:
    w = JsonlWriter(tmp_path / "run" / "metrics.jsonl")
    w.write({"step": 1})
    w.write({"step": 2, "wall_time": 5.0})
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    assert lines[1]["wall_time"] == 5.0 and lines[0]["wall_time"] > 0


def test_statistic_gauges_are_absent_until_a_step_sets_them() -> None:
    """A (re)started trainer that has not trained exports no statistic: alert rules on
    `importance_weight` and `behave_imp_weight` must not read a 0 as |0 - 1| = 1."""
    m = TrainerMetrics()
    before = generate_latest(m.registry).decode()
    for name in ("importance_weight", "behave_imp_weight", "task_reward", "tokens_per_second"):
        assert f"\nflywheel_trainer_{name} " not in before, name
    assert "flywheel_trainer_steps_total 0.0" in before  # counters do read 0: nothing done
    m.observe_step({"version": 1, "step_seconds": 0.1, "task_reward": 0.5})
    after = generate_latest(m.registry).decode()
    assert "flywheel_trainer_task_reward 0.5" in after
    assert "\nflywheel_trainer_importance_weight " not in after  # still never set
