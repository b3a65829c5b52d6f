"""The trainer's step lines across a crash (services/trainer/step_records.py `cut_metrics`).

A step's line of `metrics.jsonl` is written once its weights are published, which with
`trainer.overlap_weight_publication` happens while the next step trains; the step's
checkpoint is written before that. A copy of the line goes to `metrics.pending/` before the
checkpoint, so a trainer killed in between leaves it there. The resumed trainer must end up
with exactly one line for every step its checkpoint holds and move the others to
`metrics.lost.jsonl`, as the chaos harness (tests/chaos/harness.py `check_promises`)
demands of a whole run.
"""

from __future__ import annotations

import json
from pathlib import Path

from services.trainer.step_records import (
    INTERRUPTED_PUBLICATION,
    LOST_METRICS_FILE,
    PENDING_RECORDS_DIR,
    cut_metrics,
)


def _line(step: int) -> str:
    return json.dumps({"step": step, "group_ids": [f"g{step}a", f"g{step}b"]})


def _pending(metrics: Path, step: int, text: str | None = None) -> None:
    folder = metrics.with_name(PENDING_RECORDS_DIR)
    folder.mkdir(exist_ok=True)
    (folder / f"step-{step:08d}.json").write_text(text if text is not None else _line(step))


def _steps(path: Path) -> list[int]:
    return [json.loads(x)["step"] for x in path.read_text().splitlines()]


def test_checkpointed_steps_get_their_unwritten_lines_back(tmp_path: Path) -> None:
    """Killed after the checkpoint of step 4 with step 3's publication and step 4's still
    in flight (neither line written) and step 5 trained: lines 1-4 once, step 5 lost."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(_line(s) + "\n" for s in (1, 2)))
    for step in (3, 4, 5):
        _pending(metrics, step)
    cut_metrics(metrics, 4)
    assert _steps(metrics) == [1, 2, 3, 4]
    restored = [json.loads(x) for x in metrics.read_text().splitlines()][2:]
    assert all(r["publication"] == INTERRUPTED_PUBLICATION for r in restored)
    assert _steps(metrics.with_name(LOST_METRICS_FILE)) == [5]
    assert not list(metrics.with_name(PENDING_RECORDS_DIR).iterdir())


def test_a_line_written_before_the_kill_is_not_written_twice(tmp_path: Path) -> None:
    """The line reached `metrics.jsonl` but the trainer died before removing its pending
    copy; a pending file cut short by the kill is ignored (its step's checkpoint was not
    written, it comes after the copy)."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(_line(s) + "\n" for s in (1, 2, 3)))
    _pending(metrics, 3)
    _pending(metrics, 4, text='{"step": 4, "group_')
    cut_metrics(metrics, 2)
    assert _steps(metrics) == [1, 2]
    assert _steps(metrics.with_name(LOST_METRICS_FILE)) == [3]
    assert not list(metrics.with_name(PENDING_RECORDS_DIR).iterdir())


def test_nothing_pending_and_nothing_after_the_checkpoint_leaves_the_file_alone(
    tmp_path: Path,
) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(_line(s) + "\n" for s in (1, 2)))
    before = metrics.stat().st_mtime_ns
    cut_metrics(metrics, 2)
    assert metrics.stat().st_mtime_ns == before
    assert not metrics.with_name(LOST_METRICS_FILE).exists()
