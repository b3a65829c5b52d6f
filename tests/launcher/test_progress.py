"""The launcher's progress line (services/launcher/progress.py), from a real
`metrics.jsonl` read by `MetricsTail` as the launcher reads it during a run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.launcher.metrics_log import MetricsTail
from services.launcher.progress import ProgressLine, progress_text
from services.launcher.restarts import Restart


def _tail(tmp_path: Path) -> MetricsTail:
    path = tmp_path / "metrics.jsonl"
    rows = [
        {"step": s, "version": s, "samples": 8, "task_reward": 0.25 * s, "staleness_max": 1}
        for s in (1, 2, 3)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tail = MetricsTail(path)
    tail.poll()
    return tail


def test_the_line_shows_progress_reward_and_throughput(tmp_path: Path) -> None:
    tail = _tail(tmp_path)
    line = progress_text(tail, step=15, total=30, elapsed=12.0, restarts=[])
    # 15 of 30 steps: half of the 30-character bar; 3 x 8 samples in 12 s = 2.0/s
    assert line.startswith("[" + "#" * 15 + "." * 15 + "] 15/30 ")
    assert "v3 reward 0.750 staleness 1 2.0 samples/s 12s" in line
    assert "restarts" not in line
    no_total = progress_text(tail, step=3, total=None, elapsed=12.0, restarts=[])
    assert no_total.startswith("v3 reward")


def test_restarts_name_the_last_one(tmp_path: Path) -> None:
    died = Restart("buffer", "signal SIGKILL", -9, died_at=0.0, backoff_seconds=1.0)
    line = progress_text(_tail(tmp_path), 3, 30, 12.0, [died, died])
    assert " restarts 2 (last: buffer, signal SIGKILL, " in line


def test_logs_get_plain_lines_not_a_redrawn_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ProgressLine(start_time=0.0).show(_tail(tmp_path), 3, 30, [])
    err = capsys.readouterr().err  # captured: not a terminal
    assert not err.startswith("\r") and err.endswith("\n") and err.count("\n") == 1
    assert "3/30" in err
