"""The run report's checks, on hand-made inputs."""

from __future__ import annotations

from services.launcher.report import check_invariants, flywheel_series

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
