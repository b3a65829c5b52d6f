"""Follows the trainer's `metrics.jsonl` as it grows (one JSON object per step).

A trainer that dies and resumes from its last checkpoint trains the steps after that
checkpoint again: their records are written a second time (or the file is cut back to the
checkpoint and rewritten). Either way `records` holds one record per step, the latest one
(the life whose weights survived), and `superseded` the records it replaced. Lines without
a `step` (events, not steps) go to `others`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class MetricsTail:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        self.superseded: list[dict[str, Any]] = []
        self.others: list[dict[str, Any]] = []
        self._offset = 0
        self._partial = ""

    @property
    def last(self) -> dict[str, Any]:
        return self.records[-1] if self.records else {}

    def poll(self) -> list[dict[str, Any]]:
        """Read lines appended since the last call; a half-written last line waits. A file
        shorter than what was read (rewritten) is read again from its start."""
        if not self.path.exists():
            return []
        if self.path.stat().st_size < self._offset:
            self.superseded.extend(self.records)
            self.records, self.others, self._offset, self._partial = [], [], 0, ""
        with open(self.path) as fh:
            fh.seek(self._offset)
            chunk = fh.read()
            self._offset = fh.tell()
        text = self._partial + chunk
        lines = text.split("\n")
        self._partial = lines.pop()
        new = [json.loads(line) for line in lines if line.strip()]
        for record in new:
            self._add(record)
        return new

    def _add(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        if step is None:
            self.others.append(record)
            return
        keep = [r for r in self.records if r["step"] < step]
        self.superseded.extend(self.records[len(keep) :])
        self.records = [*keep, record]
