"""Payloads of recently put groups, kept in the buffer's memory to answer claims.

Why: a claim otherwise reads every group's megabytes back out of Redis, which costs Redis
(copying them into and out of the claim script) and this process (parsing a reply as large
as the batch) as much again as the put did: measured, more than a third of the claim's CPU.
In steady state the trainer claims what rollout put moments ago, so the bytes the buffer
received are still at hand.

Redis stays the one durable copy and the one place that decides *which* groups a claim
gets: the cache only supplies bytes, and a group it lacks (put through another replica,
before a restart, or evicted) is read from Redis. An entry is keyed by group id and checked
against the group's pending-set member (`<seq>:<id>`, unique per admission), so bytes from
an earlier admission of the same id are never served. Entries leave on ack, on a drop, and,
oldest first, when `max_bytes` would be exceeded: groups are served oldest version first,
so the oldest entries are the ones least likely to be claimed from here again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class PayloadCache:
    """A byte-bounded map group id -> (member, payload), evicting in insertion order."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, tuple[str, bytes]] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, group_id: str, member: str, payload: bytes | memoryview) -> None:
        """Keep a copy (a view would pin the whole request it points into)."""
        size = len(payload)
        if size > self.max_bytes:
            return
        self.discard((group_id,))
        while self.bytes + size > self.max_bytes:
            _, (_, old) = self._entries.popitem(last=False)
            self.bytes -= len(old)
        self._entries[group_id] = (member, bytes(payload))
        self.bytes += size

    def get(self, group_id: str, member: str) -> bytes | None:
        entry = self._entries.get(group_id)
        if entry is None or entry[0] != member:
            return None
        return entry[1]

    def discard(self, group_ids: Iterable[str]) -> None:
        for group_id in group_ids:
            entry = self._entries.pop(group_id, None)
            if entry is not None:
                self.bytes -= len(entry[1])

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0
