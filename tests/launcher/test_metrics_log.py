"""The launcher's view of `metrics.jsonl`: one record per step, the latest life's, when a
resumed trainer writes the steps after its checkpoint again or rewrites the file."""

from __future__ import annotations

import json
from pathlib import Path

from services.launcher.metrics_log import MetricsTail


def _append(path: Path, *records: dict) -> None:
    with path.open("a") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")


def test_a_step_written_again_replaces_the_older_record_and_events_are_not_steps(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    _append(path, {"step": 1, "version": 1}, {"step": 2, "version": 2}, {"step": 3, "version": 3})
    tail.poll()
    # The trainer died after step 3 and resumed from its step-2 checkpoint: step 3 again.
    _append(path, {"step": 3, "version": 4}, {"event": "completed"})
    tail.poll()
    assert [(r["step"], r["version"]) for r in tail.records] == [(1, 1), (2, 2), (3, 4)]
    assert tail.superseded == [{"step": 3, "version": 3}]
    assert tail.last == {"step": 3, "version": 4}  # not the event line
    assert tail.others == [{"event": "completed"}]


def test_a_file_cut_back_is_read_again_from_its_start(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    _append(path, {"step": 1}, {"step": 2}, {"step": 3})
    tail.poll()
    path.write_text(json.dumps({"step": 1}) + "\n")  # cut back to the checkpoint at step 1
    tail.poll()
    _append(path, {"step": 2, "version": 5})
    tail.poll()
    assert tail.records == [{"step": 1}, {"step": 2, "version": 5}]
    assert len(tail.superseded) == 3


def test_a_file_replaced_and_grown_past_the_old_offset_is_read_again(tmp_path):
    # The trainer's cut-back is a new file renamed over the old one; the resumed trainer may
    # append past the old size before the next poll, so the size alone does not show it
    # (the chaos run's launcher died here of a JSONDecodeError mid-line).
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    _append(path, {"step": 1}, {"step": 2})
    tail.poll()
    tmp = tmp_path / ".metrics.jsonl.tmp"
    tmp.write_text(json.dumps({"step": 1}) + "\n")
    tmp.replace(path)
    _append(path, {"step": 2, "version": 7, "note": "x" * 64}, {"step": 3, "version": 8})
    tail.poll()
    assert tail.records == [
        {"step": 1},
        {"step": 2, "version": 7, "note": "x" * 64},
        {"step": 3, "version": 8},
    ]
    assert tail.unreadable == 0


def test_a_line_cut_short_by_a_killed_writer_is_skipped_and_counted(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    with path.open("a") as fh:
        fh.write(json.dumps({"step": 1}) + "\n" + '{"step": 2, "ver')  # killed mid-write
    tail.poll()
    _append(path, {"step": 2, "version": 2})  # the next life writes on the same line
    _append(path, {"step": 3})
    tail.poll()
    assert [r["step"] for r in tail.records] == [1, 3]
    assert tail.unreadable == 1
