"""Follows the trainer's `metrics.jsonl` as it grows (one JSON object per step).

A trainer that dies and resumes from its last checkpoint trains the steps after that
checkpoint again: their records are written a second time (or the file is cut back to the
checkpoint and rewritten). Either way `records` holds one record per step, the latest one
(the life whose weights survived), and `superseded` the records it replaced. Lines without
a `step` (events, not steps) go to `others`.

The trainer cuts the file back by writing a new file and renaming it over the old one, and
may append to it again before the next poll: a new inode (not only a shorter file) means
"read again from the start". A trainer killed in the middle of a write leaves a line cut
short, which the next life's first record then follows on the same line: such a line is
counted in `unreadable` and skipped, never raised, so the launcher watching the run does
not die of the very fault it is there to survive.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class MetricsTail:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        self.superseded: list[dict[str, Any]] = []
        self.others: list[dict[str, Any]] = []
        self.unreadable = 0
        self._offset = 0
        self._partial = ""
        self._identity: tuple[int, int] | None = None

    @property
    def last(self) -> dict[str, Any]:
        return self.records[-1] if self.records else {}

    def poll(self) -> list[dict[str, Any]]:
        """Read lines appended since the last call; a half-written last line waits. A file
        replaced (another inode) or shorter than what was read is read again from its start."""
        try:
            fh = open(self.path, "rb")  # noqa: SIM115 -- closed by the `with` below
        except FileNotFoundError:
            return []
        with fh:
            st = os.fstat(fh.fileno())
            identity = (st.st_dev, st.st_ino)
            if identity != self._identity or st.st_size < self._offset:
                if self._identity is not None:
                    self.superseded.extend(self.records)
                    self.records, self.others, self._offset, self._partial = [], [], 0, ""
                self._identity = identity
            fh.seek(self._offset)
            chunk = fh.read()
            self._offset = fh.tell()
        text = self._partial + chunk.decode("utf-8", errors="replace")
        lines = text.split("\n")
        self._partial = lines.pop()
        new: list[dict[str, Any]] = []
        for line in lines:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                self.unreadable += 1
                continue
            if isinstance(record, dict):
                new.append(record)
                self._add(record)
            else:
                self.unreadable += 1
        return new

    def _add(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        if step is None:
            self.others.append(record)
            return
        keep = [r for r in self.records if r["step"] < step]
        self.superseded.extend(self.records[len(keep) :])
        self.records = [*keep, record]
