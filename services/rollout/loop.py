"""The rollout loop: reserve capacity, run a workflow episode, put the group, repeat.

Per group:
1. reserve one unit of capacity from the buffer (the staleness budget: the buffer grants
   only while the groups in flight cannot become older than `max_head_offpolicyness`);
   nothing granted -> wait `retry_after_ms` and ask again;
2. take the next prompt and run `workflow.arun_episode(engine, data)` (bounded by
   `request_timeout`);
3. stamp ids (a fresh group id, `group_id/i` trajectory ids, reservation, replica) and put
   it; transient put failures are retried with the *same* group id (the buffer dedups);
4. on any failure release the reservation so capacity does not leak.

The buffer client rides through a buffer (or Redis) outage of up to
`services.peer_outage_budget_s`: a reserve, put or release made while the buffer restarts
completes once it is back. For an outage longer than that, nothing is left behind either:
a release that failed is remembered and sent again by a task of its own (it does not wait
for a free slot) until the buffer answers (releasing an id twice, or one a put already fulfilled, is harmless:
ids are unique and a release only removes what is still held); and a reservation request
whose answer was lost is asked again under the same request id, so the buffer hands back
the ids it granted the first time instead of granting new ones. `docs/buffer.md` argues why
this keeps the capacity formula exact.

At most `max_concurrent_rollouts` groups are in flight. `pause()` (from the trainer) stops
starting groups and holds the engine between decode steps; `drain()` (SIGTERM) stops
starting groups and waits for those in flight to finish and be put.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from services.common.aio import stop_task, wait_event
from services.core.contracts import RolloutWorkflow
from services.core.errors import InvalidGroupError, RewardUnavailableError
from services.core.types import TrajectoryGroup
from services.rollout.data.datasets import PromptDataset
from services.rollout.engine.base import EngineBase
from services.rollout.metrics import RolloutMetrics

log = logging.getLogger(__name__)

RESERVE_WAIT_MS = 2000
"""How long the buffer may hold a reservation call with nothing to grant: the next groups
start the moment the trainer takes a batch or moves the version, not at the next poll."""


class EpisodeSlots:
    """Free episode slots of one replica (`max_concurrent_rollouts`): taken all at once,
    so one reservation call asks for every free slot, and given back one by one as
    episodes end."""

    def __init__(self, n: int) -> None:
        self.free = n
        self._freed = asyncio.Event()

    async def take_all(self) -> int:
        """Wait for at least one free slot, then take every free one."""
        while self.free == 0:
            self._freed.clear()
            await self._freed.wait()
        n, self.free = self.free, 0
        return n

    def give(self, n: int = 1) -> None:
        self.free += n
        self._freed.set()


@dataclass
class LoopStats:
    groups_started: int = 0
    groups_produced: int = 0
    reserves_reissued: int = 0  # held Reserves asked again because new weights arrived
    rejected: dict[str, int] = field(default_factory=dict)

    def reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1


class RolloutLoop:
    def __init__(
        self,
        *,
        engine: EngineBase,
        workflow: RolloutWorkflow,
        dataset: PromptDataset,
        buffer: Any,
        rollout_id: str,
        max_concurrent: int,
        request_timeout: float = 3600.0,
        put_retries: int = 5,
        metrics: RolloutMetrics | None = None,
        check_trajectory_format: bool = False,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        max_head_offpolicyness: int | None = None,
        catch_up: Callable[[], Awaitable[bool]] | None = None,
        on_behind: Callable[[bool], None] | None = None,
        reserve_wait_ms: int = RESERVE_WAIT_MS,
    ) -> None:
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent_rollouts={max_concurrent}: must be >= 1")
        self.engine = engine
        self.workflow = workflow
        self.dataset = dataset
        self.buffer = buffer
        self.rollout_id = rollout_id
        self.max_concurrent = max_concurrent
        self.reserve_wait_ms = reserve_wait_ms
        self.request_timeout = request_timeout
        self.put_retries = put_retries
        self.max_head_offpolicyness = max_head_offpolicyness
        self.catch_up = catch_up
        self._last_catch_up = -1
        self.on_behind = on_behind
        self.behind = False  # more than eta behind the buffer, and no catch-up helped
        self.metrics = metrics
        self.check_trajectory_format = check_trajectory_format
        self.stats = LoopStats()
        self._sleep = sleep
        self._slots = EpisodeSlots(max_concurrent)
        self._running = asyncio.Event()
        self._running.set()
        self._draining = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._main: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._unreleased: set[str] = set()  # reservations a failed release left held
        self._releaser: asyncio.Task[None] | None = None
        self._reserve_rid: str | None = None  # a reserve whose answer never came
        self._new_weights = asyncio.Event()  # set by weights_changed()

    # ---------------------------------------------------------------- control

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def groups_in_flight(self) -> int:
        return len(self._tasks)

    @property
    def unreleased_reservations(self) -> int:
        """Reservations given up on whose release has not reached the buffer yet."""
        return len(self._unreleased)

    async def pause(self) -> None:
        self._running.clear()
        await self.engine.pause()

    async def resume(self) -> None:
        await self.engine.resume()
        self._running.set()

    def weights_changed(self) -> None:
        """The engine serves new weights: a Reserve the buffer holds now is asked again with
        the new served version (the budget a new version opens counts from the version a
        replica serves, so a held call that still says the old one waits out its hold for
        nothing). Called by the servicer after every weight update that loaded."""
        self._new_weights.set()

    def start(self) -> asyncio.Task[None]:
        self._main = asyncio.create_task(self.run(), name="rollout-loop")
        return self._main

    async def drain(self, timeout: float = 60.0) -> None:
        """Start no new groups; let those in flight finish (engine resumed), then stop."""
        self._draining = True
        self._wake.set()
        self._running.set()
        await self.engine.resume()
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=timeout)
            if pending:
                log.warning("drain timed out; aborting groups in flight", extra={"n": len(pending)})
                await self.engine.abort_all()
                await asyncio.wait(pending, timeout=10.0)
        if self._main is not None:
            await stop_task(self._main)  # cancelled again if a library loses the cancel
        if self._releaser is not None:  # if it cannot finish, the next start releases by id
            await asyncio.wait({self._releaser}, timeout=10.0)
            await stop_task(self._releaser)

    # ------------------------------------------------------------------- loop

    async def release_stale_reservations(self) -> None:
        """A restarted replica gives back what its previous incarnation reserved."""
        try:
            n = await self.buffer.release([], rollout_id=self.rollout_id)
            if n:
                log.info("released reservations of a previous run", extra={"released": n})
        except Exception as exc:  # noqa: BLE001 - best effort at start-up
            log.warning("could not release previous reservations", extra={"error": str(exc)})

    async def run(self) -> None:
        await self.release_stale_reservations()
        held = 0  # slots held for the reservation being asked for
        try:
            while not self._draining:
                await self._running.wait()
                if self._draining:
                    break
                if held == 0:
                    held = await self._slots.take_all()
                    if self._draining:
                        break
                held = await self._reserve_and_start(held)
        finally:
            self._slots.give(held)

    async def _reserve_and_start(self, held: int) -> int:
        """Reserve for `held` groups and start one episode per granted id; returns the slots
        still held (all of them after a failed call, kept for its retry)."""
        # A reserve that failed is asked again under its request id and for as many groups:
        # if the buffer had granted it before the answer was lost, it hands back those ids.
        self._reserve_rid = self._reserve_rid or f"reserve-{uuid.uuid4().hex}"
        try:
            reservation = await self._reserve(held)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - buffer down: back off and retry
            log.warning("capacity reservation failed", extra={"error": str(exc)})
            await self._wait(1.0)
            return held
        if reservation is None:  # new weights during the hold: ask again, same request id
            self.stats.reserves_reissued += 1
            return held
        self._reserve_rid = None
        await self._maybe_catch_up(reservation.version)
        granted = list(reservation.reservation_ids)
        if len(granted) > held:  # not expected: a retried call asks for as many as before
            await self._release(granted[held:])
            granted = granted[:held]
        if self._draining or not self._running.is_set():
            if granted:
                await self._release(granted)
            granted = []
        for reservation_id in granted:
            row = self.dataset.next()
            self.stats.groups_started += 1
            task = asyncio.create_task(self._episode(row.as_data(), reservation_id))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self._slots.give(held - len(granted))
        self._set_gauges()
        if not granted and not self._draining and self._running.is_set():
            # A buffer that held the call answers retry_after_ms 0: ask again at once.
            await self._wait(max(reservation.retry_after_ms, 10) / 1000.0)
        return 0

    async def _reserve(self, held: int) -> Any:
        """One Reserve call for `held` groups under `_reserve_rid`, or None when new weights
        arrived while the buffer held it. The call is then cancelled; asking again under the
        same request id is harmless, since the buffer hands back what it granted under it."""
        self._new_weights.clear()
        served = getattr(self.engine, "version", None)
        call = asyncio.ensure_future(
            self.buffer.reserve(
                held,
                rollout_id=self.rollout_id,
                request_id=self._reserve_rid,
                served_version=served if isinstance(served, int) else None,
                wait_ms=self.reserve_wait_ms,
            )
        )
        woke = asyncio.ensure_future(self._new_weights.wait())
        try:
            await asyncio.wait({call, woke}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            call.cancel()
            raise
        finally:
            woke.cancel()
        if call.done():
            return call.result()
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        return None

    async def _maybe_catch_up(self, buffer_version: int) -> None:
        """More than η behind the buffer: what we generate now would be dropped as stale,
        so pull the newest published weights (once per buffer version) before generating.
        Still that far behind afterwards (nothing published, or it failed to load), the
        replica is `behind` and says so through `on_behind(True)` (its readiness), until a
        push or a later pull brings it within η (`on_behind(False)`)."""
        eta = self.max_head_offpolicyness
        if self.catch_up is None or eta is None:
            return

        def lag() -> int:
            return buffer_version - int(getattr(self.engine, "version", buffer_version))

        if lag() > eta and buffer_version != self._last_catch_up:
            self._last_catch_up = buffer_version
            try:
                await self.catch_up()
            except Exception as exc:  # noqa: BLE001 - a failed pull leaves the old weights
                log.warning("catch-up from published weights failed", extra={"error": str(exc)})
        behind = lag() > eta
        if behind != self.behind:
            self.behind = behind
            log.log(
                logging.WARNING if behind else logging.INFO,
                "more than max_head_offpolicyness behind the buffer and nothing newer to load"
                if behind
                else "within max_head_offpolicyness of the buffer again",
                extra={"buffer_version": buffer_version, "lag": lag(), "eta": eta},
            )
            if self.on_behind is not None:
                self.on_behind(behind)

    async def _wait(self, seconds: float) -> None:
        """Sleep, but wake early on drain."""
        self._wake.clear()
        await wait_event(self._wake, seconds)

    def _set_gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.groups_in_flight.set(len(self._tasks))

    def _reject(self, reason: str) -> None:
        self.stats.reject(reason)
        if self.metrics is not None:
            self.metrics.groups_rejected.labels(reason=reason).inc()

    async def _release(self, reservation_ids: list[str]) -> None:
        """Give reservations back; while the buffer is unreachable, hold them for the
        releaser task instead of waiting out the outage here."""
        peer = getattr(self.buffer, "peer", None)
        if peer is not None and peer.down:
            self._hold(reservation_ids)
            return
        try:
            await self.buffer.release(reservation_ids)
        except asyncio.CancelledError:
            self._hold(reservation_ids)
            raise
        except Exception as exc:  # noqa: BLE001 - the releaser task sends it again
            self._hold(reservation_ids)
            log.warning(
                "could not release reservations; releasing them when the buffer answers",
                extra={"error": str(exc), "held": len(self._unreleased)},
            )

    def _hold(self, reservation_ids: list[str]) -> None:
        self._unreleased.update(reservation_ids)
        if self._releaser is None or self._releaser.done():
            self._releaser = asyncio.create_task(self._release_held(), name="rollout-release")

    async def _release_held(self) -> None:
        """Release the held reservations as soon as the buffer answers (idempotent: ids are
        unique and a release removes only reservations still held)."""
        while self._unreleased:
            ids = sorted(self._unreleased)
            try:
                n = await self.buffer.release(ids)
            except Exception as exc:  # noqa: BLE001 - still down after the client's budget
                log.warning("buffer still unreachable", extra={"error": str(exc), "held": len(ids)})
                await asyncio.sleep(1.0)
                continue
            self._unreleased.difference_update(ids)
            log.info(
                "released reservations held through a buffer outage",
                extra={"reservations": len(ids), "released": n},
            )

    async def _episode(self, data: dict[str, Any], reservation_id: str) -> None:
        group_id = uuid.uuid4().hex
        try:
            try:
                async with asyncio.timeout(self.request_timeout):  # not wait_for: see aio.py
                    group = await self.workflow.arun_episode(self.engine, data)
            except TimeoutError:
                self._reject("timeout")
                await self._release([reservation_id])
                return
            except asyncio.CancelledError:
                await self._release([reservation_id])
                raise
            except Exception as exc:  # noqa: BLE001 - one bad episode must not stop the loop
                log.exception("episode failed", extra={"prompt_id": data.get("prompt_id")})
                self._reject(
                    "reward_unavailable" if isinstance(exc, RewardUnavailableError) else "error"
                )
                await self._release([reservation_id])
                return
            if group is None:
                self._reject("workflow_skipped")
                await self._release([reservation_id])
                return
            self._stamp(group, group_id, reservation_id)
            if self.check_trajectory_format:
                try:
                    _check_group(group)
                except ValueError as exc:
                    log.warning("workflow output malformed", extra={"error": str(exc)})
                    self._reject("invalid")
                    await self._release([reservation_id])
                    return
            if self.metrics is not None:
                for t in group.trajectories:
                    self.metrics.observe_completion(t.stop_reason)
            await self._put(group)
        finally:
            self._slots.give()
            self._set_gauges()

    def _stamp(self, group: TrajectoryGroup, group_id: str, reservation_id: str) -> None:
        group.group_id = group_id
        group.reservation_id = reservation_id
        group.rollout_id = self.rollout_id
        for i, t in enumerate(group.trajectories):
            t.group_id = group_id
            t.trajectory_id = f"{group_id}/{i}"

    async def _put(self, group: TrajectoryGroup) -> None:
        for attempt in range(self.put_retries + 1):
            try:
                result = await self.buffer.put(group, request_id=f"put-{group.group_id}")
            except Exception as exc:  # noqa: BLE001 - classify below
                invalid = isinstance(exc, InvalidGroupError)
                if invalid or attempt == self.put_retries:
                    log.warning("put failed", extra={"group_id": group.group_id, "error": str(exc)})
                    self._reject("invalid" if invalid else "put_failed")
                    await self._release([group.reservation_id])
                    return
                await self._sleep(min(5.0, 0.2 * 2**attempt))
                continue
            if result.stored:
                self.stats.groups_produced += 1
                if self.metrics is not None:
                    self.metrics.groups_produced.inc()
                    rewards = group.rewards
                    self.metrics.task_reward.set(sum(rewards) / max(len(rewards), 1))
            else:
                self._reject(result.result)
            return


def _check_group(group: TrajectoryGroup) -> None:
    """Debug check of a custom workflow's output (rollout.check_trajectory_format)."""
    for t in group.trajectories:
        n = t.num_tokens
        for name in ("loss_mask", "logprobs", "versions"):
            if getattr(t, name).shape != (n,):
                raise ValueError(
                    f"trajectory {t.trajectory_id}: {name} is not aligned to input_ids"
                )
        if (t.versions[: t.prompt_len] != -1).any():
            raise ValueError(f"trajectory {t.trajectory_id}: prompt tokens must carry version -1")
        if t.loss_mask[: t.prompt_len].any():
            raise ValueError(f"trajectory {t.trajectory_id}: prompt tokens must have loss_mask 0")
