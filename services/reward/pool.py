"""The worker pool: bounded queue, per-call deadlines that kill and replace, honest statuses.

Each of `num_workers` slots owns one worker process and feeds it chunks of queued items,
one frame per chunk, keeping the next chunk queued behind the running one; the worker
writes one result per item. Chunks amortise the hop without giving up per-item
deadlines: item k's clock starts when item k-1 finished in the worker (`t1` in its
result), and the service waits for each result only until that item's deadline.

When a deadline passes the worker gets SIGKILL with everything its functions started —
a hung parser, a busy loop in C, a child it forked, a `setsid` helper: all gone — the
item is TIMEOUT, the rest of its chunk goes back to the front of the queue, and the slot
starts a fresh worker. A worker that dies (memory limit hit inside native code, a
segfault, `os._exit`) costs only the item it was running (ERROR, with the exit status)
and is replaced the same way; one that dies while idle is replaced at once, so
`ready_workers` counts only live workers.

Readiness is `ready_workers > 0`: the pool tells `on_ready_change` when that flips, so
the service's gRPC health says NOT_SERVING while no worker is up (for instance while
none can start: each failed start is counted and retried with back-off).

The queue is bounded: `submit` takes all items of a request or none (`PoolFullError`),
so overload turns into RESOURCE_EXHAUSTED at the door instead of latency for everyone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.reward.metrics import RewardMetrics
from services.reward.process import WorkerGone, WorkerProcess, describe_exit, spawn_worker
from services.reward.protocol import ProtocolError, encode_frame

log = logging.getLogger(__name__)

OK, TIMEOUT, ERROR = "OK", "TIMEOUT", "ERROR"


class PoolFullError(Exception):
    """The queue cannot take the request's items now; retry later."""

    def __init__(self, wanted: int, free: int) -> None:
        super().__init__(f"reward queue full: {wanted} items asked, {free} free")
        self.wanted = wanted
        self.free = free


class PoolClosedError(Exception):
    """The pool is shutting down."""


@dataclass(frozen=True)
class PoolConfig:
    num_workers: int = 2
    max_queue: int = 8192
    max_chunk: int = 16
    memory_bytes: int = 4 << 30  # RLIMIT_AS per worker; 0 = unlimited
    cpu_seconds: float = 60.0  # RLIMIT_CPU per call; 0 = unlimited
    start_timeout_s: float = 120.0
    coalesce_s: float = 0.002  # pause between reading results of a worker (see _feed)
    preload: tuple[str, ...] = ()
    warmup: tuple[str, ...] = ()


@dataclass(frozen=True)
class TaskResult:
    status: str  # OK | TIMEOUT | ERROR | INVALID_INPUT (raised by the function)
    reward: float
    message: str
    seconds: float  # time the function ran in its worker (until killed, for TIMEOUT)


@dataclass
class ScoreTask:
    """One item to score. `payload` holds prompt, completion (str), prompt_ids,
    completion_ids, answer and kwargs (a dict), exactly as the function receives them."""

    fn_name: str
    fn_path: str
    payload: dict[str, Any]
    deadline_s: float
    future: asyncio.Future[TaskResult] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )

    def resolve(self, result: TaskResult) -> None:
        if not self.future.done():
            self.future.set_result(result)


@dataclass(frozen=True)
class _Sent:
    """A task written to a worker, and when."""

    task: ScoreTask
    sent_at: float


class WorkerPool:
    """`num_workers` worker processes behind one bounded queue."""

    def __init__(self, config: PoolConfig, metrics: RewardMetrics | None = None) -> None:
        if config.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {config.num_workers}")
        self.config = config
        self.metrics = metrics
        self._queue: deque[ScoreTask] = deque()
        self._work: asyncio.Event | None = None
        self._slots: list[asyncio.Task[None]] = []
        self._workers: dict[int, WorkerProcess] = {}
        self._inflight: dict[int, deque[_Sent]] = {}
        self._closing = False
        self._started = False
        self._last_start_error = ""
        self._was_ready = False
        self.on_ready_change: Callable[[bool], None] | None = None
        """Called with the new value whenever `ready_workers > 0` flips (on the loop)."""

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self, wait_ready: bool = True) -> None:
        """Start every slot; with `wait_ready`, return once all workers said ready (or
        raise when none could start)."""
        self._work = asyncio.Event()
        self._started = True
        self._slots = [
            asyncio.create_task(self._slot_loop(i), name=f"reward-slot-{i}")
            for i in range(self.config.num_workers)
        ]
        if not wait_ready:
            return
        deadline = time.monotonic() + self.config.start_timeout_s
        while self.ready_workers < self.config.num_workers:
            if time.monotonic() > deadline:
                if self.ready_workers == 0:
                    await self.close()
                    raise RuntimeError(f"no reward worker started: {self._last_start_error}")
                log.warning(
                    "only %d/%d reward workers ready", self.ready_workers, self.config.num_workers
                )
                return
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        """Stop the slots, kill the workers, fail what is queued or in flight."""
        self._closing = True
        if self._work is not None:
            self._work.set()
        for slot_task in self._slots:
            slot_task.cancel()
        for slot_task in self._slots:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await slot_task
        for worker in list(self._workers.values()):
            await self._reap(worker)
        self._workers.clear()
        pending = [sent.task for inflight in self._inflight.values() for sent in inflight]
        self._inflight.clear()
        pending.extend(self._queue)
        self._queue.clear()
        for task in pending:
            if not task.future.done():
                task.future.set_exception(PoolClosedError("reward pool closed"))
        self._update_gauges()

    # --- introspection -------------------------------------------------------------------

    @property
    def ready_workers(self) -> int:
        return len(self._workers)

    def worker_pids(self) -> list[int]:
        return sorted(w.pid for w in self._workers.values())

    @property
    def queued(self) -> int:
        return len(self._queue)

    # --- submission ----------------------------------------------------------------------

    def submit(self, tasks: Sequence[ScoreTask]) -> None:
        """Queue all of `tasks` or none of them (PoolFullError)."""
        if self._closing or not self._started:
            raise PoolClosedError("reward pool is not running")
        free = self.config.max_queue - len(self._queue)
        if len(tasks) > free:
            raise PoolFullError(len(tasks), max(free, 0))
        self._queue.extend(tasks)
        self._update_gauges()
        self._signal_work()

    async def score(self, tasks: Sequence[ScoreTask]) -> list[TaskResult]:
        self.submit(tasks)
        return list(await asyncio.gather(*(t.future for t in tasks)))

    def _signal_work(self) -> None:
        if self._work is not None and self._queue:
            self._work.set()

    def _update_gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_items.set(len(self._queue))
            self.metrics.workers_ready.set(len(self._workers))
        ready = bool(self._workers)
        if ready != self._was_ready:
            self._was_ready = ready
            if self.on_ready_change is not None:
                self.on_ready_change(ready)

    def _wake_slots(self) -> None:
        """Wake the idle slots (a worker died while waiting for work)."""
        if self._work is not None:
            self._work.set()

    # --- the queue -----------------------------------------------------------------------

    def _take_nowait(self) -> list[ScoreTask]:
        """A fair share of the queue (at most `max_chunk`), skipping abandoned tasks."""
        share = math.ceil(len(self._queue) / self.config.num_workers)
        n = max(1, min(self.config.max_chunk, share))
        chunk: list[ScoreTask] = []
        while self._queue and len(chunk) < n:
            task = self._queue.popleft()
            if not task.future.done():  # the caller went away: skip it
                chunk.append(task)
        if self._queue:
            self._signal_work()
        self._update_gauges()
        return chunk

    async def _take(self, worker: WorkerProcess) -> list[ScoreTask] | None:
        """Wait until there is work (or the pool closes), then take a share; None, with
        nothing taken, when `worker` dies meanwhile."""
        assert self._work is not None
        while not self._queue and not self._closing:
            if worker.gone:
                return None
            self._work.clear()
            await self._work.wait()
        return None if worker.gone else self._take_nowait()

    def _requeue(self, tasks: Sequence[ScoreTask]) -> None:
        """Put tasks a dead worker had not started back at the front, in order."""
        self._queue.extendleft(reversed(tasks))
        self._update_gauges()
        self._signal_work()

    def _fail_queued(self, message: str) -> None:
        while self._queue:
            self._queue.popleft().resolve(TaskResult(ERROR, 0.0, message, 0.0))
        self._update_gauges()

    # --- the slots -----------------------------------------------------------------------

    async def _slot_loop(self, slot: int) -> None:
        """Keep one worker alive in this slot and feed it until the pool closes."""
        failures = 0
        while not self._closing:
            try:
                worker = await self._spawn()
                failures = 0
            except Exception as exc:  # noqa: BLE001 - reported and retried with backoff
                failures += 1
                self._last_start_error = f"{type(exc).__name__}: {exc}"
                if self.metrics is not None:
                    self.metrics.worker_start_failures.inc()
                log.error(
                    "reward worker failed to start",
                    extra={"slot": slot, "error": self._last_start_error},
                )
                if not self._workers:
                    self._fail_queued(f"no reward worker could start: {self._last_start_error}")
                await asyncio.sleep(min(30.0, 0.5 * 2 ** min(failures, 6)))
                continue
            worker.protocol.on_gone = self._wake_slots
            self._workers[slot] = worker
            self._update_gauges()
            try:
                await self._feed(slot, worker)
            finally:
                if self._workers.get(slot) is worker:
                    del self._workers[slot]
                    self._update_gauges()
                    await self._reap(worker)

    async def _spawn(self) -> WorkerProcess:
        c = self.config
        return await spawn_worker(
            memory_bytes=c.memory_bytes,
            cpu_seconds=c.cpu_seconds,
            preload=c.preload,
            warmup=c.warmup,
            start_timeout_s=c.start_timeout_s,
        )

    async def _reap(self, worker: WorkerProcess, *, kill: bool = True) -> int | None:
        """Kill (unless already killed) and reap `worker`; count the processes its
        functions started that were still running (killed with it). Returns the exit
        status."""
        code = await (worker.kill() if kill else worker.wait())
        self._count_descendants(worker)
        return code

    def _count_descendants(self, worker: WorkerProcess) -> None:
        if worker.descendants_killed:
            log.warning(
                "processes started by reward functions killed with their worker",
                extra={"pid": worker.pid, "processes": worker.descendants_killed},
            )
            if self.metrics is not None:
                self.metrics.descendants_killed.inc(worker.descendants_killed)
            worker.descendants_killed = 0

    def _take_out(self, slot: int, worker: WorkerProcess, reason: str) -> None:
        """Remove the worker from service and count the restart. Done before the failed
        item is resolved, so a caller that sees TIMEOUT never sees the old worker listed."""
        if self._workers.get(slot) is worker:
            del self._workers[slot]
        self._update_gauges()
        if self.metrics is not None:
            self.metrics.worker_restarts.labels(reason=reason).inc()

    def _send(self, worker: WorkerProcess, chunk: list[ScoreTask], inflight: deque[_Sent]) -> None:
        """Write one chunk to the worker; an item that cannot be encoded fails alone."""
        items = [{"id": i, "fn": t.fn_path, **t.payload} for i, t in enumerate(chunk)]
        try:
            frame = encode_frame({"op": "score", "items": items})
        except (ProtocolError, ValueError):
            keep: list[int] = []
            for i, task in enumerate(chunk):
                try:
                    encode_frame(items[i])
                    keep.append(i)
                except (ProtocolError, ValueError) as exc:
                    task.resolve(TaskResult(ERROR, 0.0, f"cannot send item to worker: {exc}", 0.0))
            chunk = [chunk[i] for i in keep]
            if not chunk:
                return
            frame = encode_frame({"op": "score", "items": [items[i] for i in keep]})
        worker.send(frame)
        sent_at = time.monotonic()
        inflight.extend(_Sent(task, sent_at) for task in chunk)

    async def _feed(self, slot: int, worker: WorkerProcess) -> None:
        """Send chunks to `worker` and collect its results until it dies or is killed.

        Up to two chunks are in flight: the next one waits in the worker's pipe while the
        current one runs, so the worker never idles while the service (busy, or not yet
        scheduled on a loaded machine) gets round to sending more. Results arrive in
        order; the head item started when the previous item ended (`t1`), or when its
        chunk was sent if the worker was idle, and its deadline counts from there.
        """
        inflight: deque[_Sent] = deque()
        self._inflight[slot] = inflight
        last_t1 = 0.0
        try:
            while not self._closing:
                if len(inflight) < self.config.max_chunk:
                    if inflight:
                        chunk = self._take_nowait()
                    else:
                        taken = await self._take(worker)
                        if taken is None:  # died while idle (kill -9, the OOM killer)
                            self._take_out(slot, worker, "crash")
                            code = await self._reap(worker)
                            log.warning(
                                "idle reward worker died; replacing it",
                                extra={"pid": worker.pid, "exit": describe_exit(code)},
                            )
                            return
                        chunk = taken
                    if chunk:
                        self._send(worker, chunk, inflight)
                if not inflight:
                    continue
                head = inflight[0]
                deadline = max(last_t1, head.sent_at) + head.task.deadline_s
                try:
                    if worker.has_frame():
                        result = await worker.recv()  # already here: no timer, no suspension
                    else:
                        # `timeout_at` (a timer, not a task per item like `wait_for`); the
                        # loop's clock is time.monotonic, the clock of the deadline.
                        async with asyncio.timeout_at(deadline):
                            result = await worker.recv()
                except TimeoutError:
                    # Kill first, answer at once, reap after: the caller waits for the
                    # deadline plus a signal, not for the kernel to free a large heap.
                    self._take_out(slot, worker, "timeout")
                    worker.send_kill()
                    self._count_descendants(worker)
                    inflight.popleft()
                    self._requeue([s.task for s in inflight])
                    inflight.clear()
                    elapsed = time.monotonic() - max(last_t1, head.sent_at)
                    self._finish(
                        head.task,
                        TaskResult(
                            TIMEOUT,
                            0.0,
                            f"deadline of {head.task.deadline_s:g}s exceeded; "
                            f"worker {worker.pid} killed and replaced",
                            elapsed,
                        ),
                    )
                    await self._reap(worker, kill=False)
                    return
                except (WorkerGone, ConnectionError, ProtocolError) as exc:
                    self._take_out(slot, worker, "crash")
                    code = await self._reap(worker)
                    inflight.popleft()
                    self._requeue([s.task for s in inflight])
                    inflight.clear()
                    detail = str(exc) if isinstance(exc, ProtocolError) else describe_exit(code)
                    self._finish(
                        head.task,
                        TaskResult(
                            ERROR,
                            0.0,
                            f"worker {worker.pid} died while scoring ({detail}); a crash in "
                            f"native code or the {self.config.memory_bytes >> 20} MiB memory limit",
                            time.monotonic() - max(last_t1, head.sent_at),
                        ),
                    )
                    return
                inflight.popleft()
                last_t1 = float(result["t1"])
                outcome = TaskResult(
                    result["status"],
                    float(result["reward"]),
                    result["message"],
                    max(0.0, last_t1 - float(result["t0"])),
                )
                if result.get("restart"):
                    # The worker broke a limit, reported it and exits: replace it first.
                    self._take_out(slot, worker, result.get("reason") or "limit")
                    await self._reap(worker)
                    self._requeue([s.task for s in inflight])
                    inflight.clear()
                    self._finish(head.task, outcome)
                    return
                self._finish(head.task, outcome)
                if inflight and not worker.has_frame() and self.config.coalesce_s > 0:
                    # Let a few results pile up and handle them in one wake-up: on few
                    # cores the service's per-wake-up cost competes with the workers.
                    # Deadlines are absolute, so this delays reading a result, never a
                    # kill, by at most coalesce_s.
                    await asyncio.sleep(self.config.coalesce_s)
        finally:
            if self._inflight.get(slot) is inflight:
                del self._inflight[slot]
            if inflight:  # only when cancelled: every other exit cleared it
                if self._closing:
                    for sent in inflight:
                        if not sent.task.future.done():
                            sent.task.future.set_exception(PoolClosedError("reward pool closed"))
                else:
                    self._requeue([sent.task for sent in inflight])

    def _finish(self, task: ScoreTask, result: TaskResult) -> None:
        task.resolve(result)
        self._observe(task, result.seconds)

    def _observe(self, task: ScoreTask, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.score_seconds_of(task.fn_name).observe(seconds)
