"""The launcher's progress line: step, version, reward, staleness, throughput, restarts.

On a terminal it is one line redrawn in place; in logs and CI, where a redrawn line would
pile up, one plain line every `PLAIN_EVERY_S` seconds.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

from services.launcher.metrics_log import MetricsTail
from services.launcher.restarts import Restart

PLAIN_EVERY_S = 15.0


def progress_text(
    tail: MetricsTail, step: int, total: int | None, elapsed: float, restarts: Sequence[Restart]
) -> str:
    """The line's text (without the leading carriage return)."""
    last = tail.last
    samples = sum(r.get("samples", 0) for r in tail.records)
    bar = ""
    if total:
        done = int(30 * min(step, total) / total)
        bar = "[" + "#" * done + "." * (30 - done) + f"] {step}/{total} "
    line = (
        f"{bar}v{last.get('version', 0)} reward {last.get('task_reward', float('nan')):.3f} "
        f"staleness {last.get('staleness_max', 0)} {samples / max(elapsed, 1e-9):.1f} samples/s "
        f"{elapsed:.0f}s"
    )
    if restarts:
        last_r = restarts[-1]
        line += (
            f" restarts {len(restarts)} (last: {last_r.service}, {last_r.exit}, "
            f"{time.time() - last_r.died_at:.0f}s ago)"
        )
    return line


class ProgressLine:
    """Writes the progress line to stderr: redrawn on a terminal, else now and then."""

    def __init__(self, start_time: float) -> None:
        self.start_time = start_time
        self._last_plain = 0.0

    def show(
        self, tail: MetricsTail, step: int, total: int | None, restarts: Sequence[Restart]
    ) -> None:
        line = progress_text(tail, step, total, time.time() - self.start_time, restarts)
        if sys.stderr.isatty():
            sys.stderr.write("\r" + line)
        elif time.monotonic() - self._last_plain >= PLAIN_EVERY_S:
            sys.stderr.write(line + "\n")
            self._last_plain = time.monotonic()
        else:
            return
        sys.stderr.flush()
