"""Shared state between the training loop (main thread) and the gRPC servicer (I/O thread).

The servicer never touches the model: it records requests (pause, resume, save, stop)
here, and the loop acts on them at the next step boundary, where all ranks can take part
(a checkpoint is collective). A save request carries a future the servicer awaits; the
loop resolves it with the checkpoint's path. Requests are keyed by `request_id`, so a
retried SaveCheckpoint gets the checkpoint of the first attempt instead of a second one.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SavedCheckpoint:
    path: str
    step: int
    version: int


@dataclass
class _SaveRequest:
    request_id: str
    future: Future = field(default_factory=Future)


class Control:
    """Thread-safe status and pending requests of one trainer job."""

    def __init__(self, *, total_train_steps: int | None, world_size: int) -> None:
        self._lock = threading.Lock()
        self.total_train_steps = total_train_steps or 0
        self.world_size = world_size
        self.step = 0
        self.version = 0
        self.phase = "starting"
        self.paused = False
        self.stop_requested = False
        self.last_stats: dict[str, float] = {}
        self.last_checkpoint = ""
        self.last_checkpoint_step = 0
        self.skipped_updates = 0
        self.unhealthy_replica_updates = 0
        self.last_step_unix = 0.0
        self._pending_saves: list[_SaveRequest] = []
        self._saves_by_id: dict[str, Future] = {}

    # -- requests (servicer side) ----------------------------------------------------------
    def set_paused(self, paused: bool) -> None:
        with self._lock:
            self.paused = paused

    def request_stop(self) -> None:
        with self._lock:
            self.stop_requested = True

    def request_save(self, request_id: str) -> Future:
        """A future resolved with a `SavedCheckpoint` (or an exception) by the loop."""
        with self._lock:
            if request_id and request_id in self._saves_by_id:
                return self._saves_by_id[request_id]
            req = _SaveRequest(request_id)
            self._pending_saves.append(req)
            if request_id:
                self._saves_by_id[request_id] = req.future
            return req.future

    # -- loop side ---------------------------------------------------------------------------
    def take_save_requests(self) -> list[Future]:
        with self._lock:
            reqs, self._pending_saves = self._pending_saves, []
        return [r.future for r in reqs]

    def has_save_requests(self) -> bool:
        with self._lock:
            return bool(self._pending_saves)

    def update(self, **fields: Any) -> None:
        with self._lock:
            for key, value in fields.items():
                if not hasattr(self, key) or key.startswith("_"):
                    raise AttributeError(f"Control has no field {key!r}")
                setattr(self, key, value)

    def finish_step(self, *, step: int, version: int, stats: dict[str, float]) -> None:
        with self._lock:
            self.step = step
            self.version = version
            self.last_stats = dict(stats)
            self.last_step_unix = time.time()

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "step": self.step,
                "version": self.version,
                "paused": self.paused,
                "phase": self.phase,
                "total_train_steps": self.total_train_steps,
                "last_stats": dict(self.last_stats),
                "world_size": self.world_size,
                "last_checkpoint": self.last_checkpoint,
                "last_checkpoint_step": self.last_checkpoint_step,
                "skipped_updates": self.skipped_updates,
                "unhealthy_replica_updates": self.unhealthy_replica_updates,
                "last_step_unix": self.last_step_unix,
                "stop_requested": self.stop_requested,
            }
