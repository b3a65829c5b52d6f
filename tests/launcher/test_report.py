"""The run report's checks, on hand-made inputs."""

from __future__ import annotations

import json
from pathlib import Path

from services.launcher.report import check_invariants, flywheel_series, ledger_summary

EXPOSITION = """# HELP flywheel_trainer_steps_total Optimizer steps.
# TYPE flywheel_trainer_steps_total counter
flywheel_trainer_steps_total 4.0
flywheel_trainer_phase_seconds_count{phase="train"} 4.0
flywheel_buffer_put_total 3.0
python_gc_objects_collected_total{generation="0"} 1.0
"""
BUFFER = {"put_total": 2, "acked_total": 2, "invariant_ok": True}
RECORDS = [{"step": 1, "version": 1, "staleness_max": 0}, {"step": 2, "version": 2}]


def test_series_names_of_one_service_only() -> None:
    assert flywheel_series(EXPOSITION, "trainer") == {
        "flywheel_trainer_steps_total",
        "flywheel_trainer_phase_seconds_count",
    }
    assert flywheel_series(EXPOSITION, "reward") == set()


def test_metrics_check_names_what_is_missing_and_where_series_came_from() -> None:
    seen = {"buffer": {"a"}, "reward": {"b"}, "rollout-0": {"c"}}
    missing = check_invariants(RECORDS, 1, BUFFER, seen)["metrics_exported"]
    assert not missing["ok"] and "no metrics from ['trainer']" in missing["detail"]
    seen["trainer"] = flywheel_series(EXPOSITION, "trainer")
    via_file = check_invariants(RECORDS, 1, BUFFER, seen, from_textfile=["trainer"])
    assert via_file["metrics_exported"]["ok"]
    assert "trainer: read from its exit textfile" in via_file["metrics_exported"]["detail"]
    seen["trainer"] = set()  # an empty textfile vouches for nothing
    assert not check_invariants(RECORDS, 1, BUFFER, seen)["metrics_exported"]["ok"]


def test_ledger_adds_the_groups_lost_with_a_crash_to_the_trainers_and_compares(
    tmp_path: Path,
) -> None:
    # 8 groups in the final weights + 2 acknowledged by a trainer that died after its
    # checkpoint = the buffer's 10; a buffer at 9 does not match.
    (tmp_path / "ledger.json").write_text(
        json.dumps({"trainer_acked": 8, "acked_lost_with_crash": 2, "resumes": 1})
    )
    ledger = ledger_summary(tmp_path, {"acked_total": 10})
    assert ledger == {
        "trainer_acked": 8,
        "acked_lost_with_crash": 2,
        "resumes": 1,
        "buffer_acked": 10,
        "ok": True,
    }
    assert not ledger_summary(tmp_path, {"acked_total": "9"})["ok"]
    # No file: a trainer that never acknowledged anything; right only if the buffer agrees.
    assert ledger_summary(tmp_path / "none", {"acked_total": 0})["ok"]
    assert not ledger_summary(tmp_path / "none", {"acked_total": 1})["ok"]
