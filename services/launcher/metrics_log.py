"""Follows the trainer's `metrics.jsonl` as it grows (one JSON object per step)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class MetricsTail:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        self._offset = 0
        self._partial = ""

    @property
    def last(self) -> dict[str, Any]:
        return self.records[-1] if self.records else {}

    def poll(self) -> list[dict[str, Any]]:
        """Read lines appended since the last call; a half-written last line waits."""
        if not self.path.exists():
            return []
        with open(self.path) as fh:
            fh.seek(self._offset)
            chunk = fh.read()
            self._offset = fh.tell()
        text = self._partial + chunk
        lines = text.split("\n")
        self._partial = lines.pop()
        new = [json.loads(line) for line in lines if line.strip()]
        self.records.extend(new)
        return new
