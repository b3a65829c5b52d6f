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

What is kept is a view into the request the group arrived in, not a copy: copying 170 KB
per group cost as much CPU as a sixth of the whole put. The bound is honest about that:
each request counts with its full size, once, for as long as any of its groups is held
(the groups of one request are put, claimed and evicted together, so this is rarely more
than their own bytes). Only views into immutable `bytes` are kept; anything else, or a
request larger than the bound, is copied.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

Payload = bytes | memoryview


class PayloadCache:
    """A byte-bounded map group id -> (member, payload), evicting in insertion order."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        """Memory held: the full size of every distinct buffer an entry points into."""
        self._entries: OrderedDict[str, tuple[str, Payload, bytes]] = OrderedDict()
        self._held: dict[int, tuple[bytes, int]] = {}  # id(buffer) -> (buffer, its entries)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def _cost(self, buffer: bytes) -> int:
        return 0 if id(buffer) in self._held else len(buffer)

    def add(self, group_id: str, member: str, payload: Payload) -> None:
        view, buffer = _view_and_buffer(payload)
        if len(buffer) > self.max_bytes:
            view = buffer = bytes(view)  # the request is too big to hold: this group alone
            if len(buffer) > self.max_bytes:
                return
        self.discard((group_id,))
        while self._entries and self.bytes + self._cost(buffer) > self.max_bytes:
            self._remove(next(iter(self._entries)))
        _, count = self._held.get(id(buffer), (buffer, 0))
        if count == 0:
            self.bytes += len(buffer)
        self._held[id(buffer)] = (buffer, count + 1)
        self._entries[group_id] = (member, view, buffer)

    def get(self, group_id: str, member: str) -> Payload | None:
        entry = self._entries.get(group_id)
        if entry is None or entry[0] != member:
            return None
        return entry[1]

    def discard(self, group_ids: Iterable[str]) -> None:
        for group_id in group_ids:
            if group_id in self._entries:
                self._remove(group_id)

    def _remove(self, group_id: str) -> None:
        _, _, buffer = self._entries.pop(group_id)
        _, count = self._held[id(buffer)]
        if count == 1:
            del self._held[id(buffer)]
            self.bytes -= len(buffer)
        else:
            self._held[id(buffer)] = (buffer, count - 1)

    def clear(self) -> None:
        self._entries.clear()
        self._held.clear()
        self.bytes = 0


def _view_and_buffer(payload: Payload) -> tuple[Payload, bytes]:
    """The payload as kept, and the immutable buffer whose lifetime it extends."""
    if isinstance(payload, bytes):
        return payload, payload
    base = payload.obj
    if type(base) is bytes and payload.contiguous:
        return payload, base
    copy = bytes(payload)  # a view into something mutable (or odd): keep our own bytes
    return copy, copy
