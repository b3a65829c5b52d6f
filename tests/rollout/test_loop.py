"""The rollout loop: unit tests of its bookkeeping with a scripted buffer, and a run against
the real buffer (real redis-server) and reward services on loopback."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from services.core.contracts import WorkflowContext
from services.core.types import SamplingParams, TrajectoryGroup
from services.rollout.data.arithmetic import write_splits
from services.rollout.data.datasets import PromptDataset, read_rows
from services.rollout.engine.torch_engine import TorchEngine
from services.rollout.loop import RolloutLoop
from services.rollout.metrics import RolloutMetrics
from services.rollout.workflows.base import RewardServiceScorer, load_workflow
from tests.rollout.loop_services import LoopServices, loop_services
from tests.waiting import holds, until

# --------------------------------------------------------------- unit: scripted buffer


class ScriptedBuffer:
    """Grants `grants` reservations, fails the first `put_failures` puts, records everything."""

    def __init__(self, grants: int, put_failures: int = 0) -> None:
        self.grants = grants
        self.put_failures = put_failures
        self.puts: list[tuple[str, str]] = []
        self.released: list[str] = []
        self.reserved: list[str] = []
        self.served_versions: list[int | None] = []

    async def reserve(
        self,
        count: int,
        *,
        rollout_id: str = "",
        request_id: str = "",
        served_version: int | None = None,
        wait_ms: int = 0,
    ) -> Any:
        from services.buffer.client import Reservation

        self.served_versions.append(served_version)
        if self.grants <= 0:
            return Reservation([], 0, 0, 20)
        self.grants -= 1
        rid = f"res-{len(self.reserved)}"
        self.reserved.append(rid)
        return Reservation([rid], 0, self.grants, 0)

    async def release(self, ids: list[str], **kw: Any) -> int:
        self.released.extend(ids)
        return len(ids)

    async def put(self, group: TrajectoryGroup, *, request_id: str) -> Any:
        from services.buffer.client import PutResult

        self.puts.append((group.group_id, request_id))
        if self.put_failures > 0:
            self.put_failures -= 1
            raise ConnectionError("buffer unavailable")
        return PutResult("admitted", "", 0)


class ScriptedWorkflow:
    def __init__(self, fail_on: set[str]) -> None:
        self.fail_on = fail_on

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> TrajectoryGroup | None:
        from services.rollout.workflows.base import build_trajectory

        if data["prompt_id"] in self.fail_on:
            raise RuntimeError("episode broke")
        t = build_trajectory(
            data["prompt_ids"], [([5, 6], [-0.1, -0.2], [0, 0], 0)], reward=1.0, stop_reason="stop"
        )
        return TrajectoryGroup(group_id="", trajectories=[t, t], prompt_id=data["prompt_id"])


def tiny_dataset(engine: TorchEngine, n: int = 3) -> PromptDataset:
    rows = [{"prompt": f"{i}+{i}=", "answer": f"#### {2 * i}", "id": f"p{i}"} for i in range(n)]
    return PromptDataset(rows, engine.tokenizer, shuffle=False)


async def run_until(loop: RolloutLoop, cond: Any) -> None:
    loop.start()
    while not cond():
        await asyncio.sleep(0.005)
    await loop.drain(timeout=10)


async def no_sleep(_: float) -> None:
    return None


async def test_put_retries_keep_the_group_id_and_failures_release(engine: TorchEngine) -> None:
    buffer = ScriptedBuffer(grants=3, put_failures=2)
    metrics = RolloutMetrics()
    loop = RolloutLoop(
        engine=engine,
        workflow=ScriptedWorkflow(fail_on={"p1"}),
        dataset=tiny_dataset(engine),
        buffer=buffer,
        rollout_id="rollout-7",
        max_concurrent=1,
        metrics=metrics,
        sleep=no_sleep,
    )
    await run_until(loop, lambda: loop.stats.groups_started == 3 and loop.groups_in_flight == 0)
    # p0: two failed puts then success, all with one group id and one request id.
    first_gid = buffer.puts[0][0]
    assert buffer.puts[:3] == [(first_gid, f"put-{first_gid}")] * 3
    # p1's episode raised: its reservation (res-1) was released, nothing put.
    assert buffer.released == ["res-1"]
    assert loop.stats.groups_produced == 2 and loop.stats.rejected == {"error": 1}
    assert metrics.groups_produced._value.get() == 2
    assert metrics.groups_rejected.labels(reason="error")._value.get() == 1
    # Every reservation names the version the engine serves (the buffer's capacity counts
    # from it when it is older than the trainer's).
    assert buffer.served_versions and set(buffer.served_versions) == {engine.version}


async def test_stamping_and_put_failure_after_retries(engine: TorchEngine) -> None:
    buffer = ScriptedBuffer(grants=1, put_failures=99)
    loop = RolloutLoop(
        engine=engine,
        workflow=ScriptedWorkflow(set()),
        dataset=tiny_dataset(engine),
        buffer=buffer,
        rollout_id="rollout-3",
        max_concurrent=2,
        put_retries=2,
        sleep=no_sleep,
    )
    await run_until(loop, lambda: len(buffer.puts) == 3 and loop.groups_in_flight == 0)
    assert buffer.released == ["res-0"] and loop.stats.rejected == {"put_failed": 1}


class VersionedBuffer(ScriptedBuffer):
    """Reports a buffer version far ahead of the engine, as after a missed weight push."""

    def __init__(self, grants: int, version: int) -> None:
        super().__init__(grants)
        self.version = version

    async def reserve(
        self,
        count: int,
        *,
        rollout_id: str = "",
        request_id: str = "",
        served_version: int | None = None,
        wait_ms: int = 0,
    ) -> Any:
        from services.buffer.client import Reservation

        r = await super().reserve(count, rollout_id=rollout_id, served_version=served_version)
        return Reservation(r.reservation_ids, self.version, r.capacity, r.retry_after_ms)


@pytest.mark.parametrize(("buffer_version", "eta", "pulls"), [(5, 1, 1), (1, 1, 0), (9, 9, 0)])
async def test_a_replica_more_than_eta_behind_pulls_published_weights(
    engine: TorchEngine, buffer_version: int, eta: int, pulls: int
) -> None:
    # engine.version is 0: behind by 5 > eta 1 -> one pull (once per buffer version, not per
    # group); behind by 1 <= 1 or 9 <= 9 -> none.
    calls: list[int] = []

    async def catch_up() -> bool:
        calls.append(engine.version)
        return True

    buffer = VersionedBuffer(grants=3, version=buffer_version)
    loop = RolloutLoop(
        engine=engine,
        workflow=ScriptedWorkflow(set()),
        dataset=tiny_dataset(engine),
        buffer=buffer,
        rollout_id="rollout-0",
        max_concurrent=1,
        sleep=no_sleep,
        max_head_offpolicyness=eta,
        catch_up=catch_up,
    )
    await run_until(loop, lambda: loop.stats.groups_started == 3 and loop.groups_in_flight == 0)
    assert len(calls) == pulls


async def test_a_replica_that_cannot_catch_up_reports_itself_behind(engine: TorchEngine) -> None:
    # Buffer at version 5, engine at 0, eta 1: generated groups would be 5 versions stale.
    # The pull finds nothing to load (returns False, the version stays 0): the loop reports
    # `on_behind(True)` once, and pulls once per buffer version, not per reservation. A push
    # of version 5 (the trainer's next publication) brings it within eta: `on_behind(False)`.
    events: list[bool] = []
    pulls: list[int] = []

    async def catch_up() -> bool:
        pulls.append(engine.version)
        return False

    loop = RolloutLoop(
        engine=engine,
        workflow=ScriptedWorkflow(set()),
        dataset=tiny_dataset(engine),
        buffer=VersionedBuffer(grants=100, version=5),
        rollout_id="rollout-0",
        max_concurrent=1,
        sleep=no_sleep,
        max_head_offpolicyness=1,
        catch_up=catch_up,
        on_behind=events.append,
    )
    saved = engine.version
    try:
        async with asyncio.timeout(30):
            loop.start()
            while loop.stats.groups_started < 3:
                await asyncio.sleep(0.005)
            assert events == [True] and loop.behind and pulls == [0]
            engine.version = 5
            while events != [True, False]:
                await asyncio.sleep(0.005)
            await loop.drain(timeout=10)
    finally:
        engine.version = saved
    assert not loop.behind and pulls == [0]


async def test_pause_stops_new_groups_until_resume(engine: TorchEngine) -> None:
    buffer = ScriptedBuffer(grants=100)
    loop = RolloutLoop(
        engine=engine,
        workflow=ScriptedWorkflow(set()),
        dataset=tiny_dataset(engine),
        buffer=buffer,
        rollout_id="r",
        max_concurrent=1,
        sleep=no_sleep,
    )
    await loop.pause()
    loop.start()

    def paused() -> bool:
        return loop.stats.groups_started == 0 and engine.paused

    await holds(paused, "no group starts while paused", hold_s=0.05)
    await loop.resume()
    await until(lambda: loop.stats.groups_produced >= 2, "two groups after resume", 60)
    await loop.drain(timeout=10)
    assert loop.groups_in_flight == 0 and loop.draining


# ------------------------------------------------ integration: real buffer and reward


@pytest.mark.integration
@pytest.mark.slow
async def test_rlvr_loop_against_real_buffer_and_reward(
    redis_server: Any, engine: TorchEngine, tmp_path: Path
) -> None:
    async with loop_services(redis_server.url, tmp_path, fn="gsm8k") as svc:
        await _rlvr_loop(engine, svc, tmp_path)


async def _rlvr_loop(engine: TorchEngine, svc: LoopServices, tmp_path: Path) -> None:
    buffer, trainer_side, reward = svc.buffer, svc.trainer_side, svc.reward
    train, _ = write_splits(tmp_path / "data", n_train=32, n_valid=4, seed=0)
    metrics = RolloutMetrics()
    ctx = WorkflowContext(
        engine.tokenizer,
        SamplingParams(n_samples=2, max_new_tokens=8, temperature=1.0, seed=None),
        RewardServiceScorer(reward, fn="gsm8k"),
        on_reward_failure=lambda s: metrics.reward_failures.labels(status=s).inc(),
    )
    loop = RolloutLoop(
        engine=engine,
        workflow=load_workflow("rlvr", ctx),
        dataset=PromptDataset(read_rows(train), engine.tokenizer, seed=0),
        buffer=buffer,
        rollout_id="rollout-0",
        max_concurrent=2,
        metrics=metrics,
    )
    loop.start()
    # Capacity for version 0 is limited by the staleness budget: the loop fills it, then waits.
    claimed = []
    while len(claimed) < 2:
        res = await trainer_side.claim(2, consumer_id="t0", wait_ms=200, allow_partial=False)
        claimed.extend(res.groups)
    for g in claimed:
        assert g.rollout_id == "rollout-0" and g.reservation_id and len(g.trajectories) == 2
        for i, t in enumerate(g.trajectories):
            assert t.trajectory_id == f"{g.group_id}/{i}" and t.group_id == g.group_id
            assert t.reward in (0.0, 1.0) and t.metadata["reward_status"] == "OK"
            assert set(t.versions[: t.prompt_len].tolist()) == {-1}
            assert set(t.generated_versions.tolist()) == {0}
    # The trainer steps: new weights (version 1) to the engine, version to the buffer, ack.
    from services.common.weights.manifest import make_manifest

    weights = engine.current_weights()
    assert (await engine.update_weights_from_tensors(weights, make_manifest(weights, 1))).ok
    await trainer_side.set_version(1)
    await trainer_side.ack([g.group_id for g in claimed], consumer_id="t0")
    later = []
    while not any(g.oldest_version == 1 for g in later):
        res = await trainer_side.claim(2, consumer_id="t0", wait_ms=200, allow_partial=True)
        later.extend(res.groups)
        await trainer_side.ack([g.group_id for g in res.groups], consumer_id="t0")
    await loop.drain(timeout=30)
    stats = await trainer_side.stats()
    assert stats.invariant_ok
    assert loop.stats.groups_produced >= 3 and loop.groups_in_flight == 0
    assert metrics.groups_produced._value.get() == loop.stats.groups_produced
    assert (
        sum(metrics.completions.labels(stop_reason=r)._value.get() for r in ("stop", "length")) >= 6
    )


# ------------------------------------ integration: a buffer outage while groups are in flight


class GatedWorkflow:
    """Each episode waits for a ticket from the test, then returns a valid two-sample group,
    so the test decides when puts happen (while the buffer is down, or after)."""

    def __init__(self) -> None:
        self.tickets = asyncio.Semaphore(0)

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> TrajectoryGroup:
        from services.rollout.workflows.base import build_trajectory

        await self.tickets.acquire()
        trajectories = [
            build_trajectory(
                data["prompt_ids"],
                [([5, 6], [-0.1, -0.2], [0, 0], 0)],
                reward=r,
                stop_reason="stop",
            )
            for r in (0.0, 1.0)
        ]
        return TrajectoryGroup(group_id="", trajectories=trajectories, prompt_id=data["prompt_id"])

    def let_through(self, n: int) -> None:
        for _ in range(n):
            self.tickets.release()


async def _buffer(redis_url: str, tmp_path: Path, port: int = 0) -> Any:
    """A real buffer on `port` (0: any); a new one on the same port is the restarted buffer
    (its state is in Redis). Capacity is bounded by concurrency only: 4 reservations."""
    from services.buffer.service import BufferParts, BufferService
    from services.common.config import BufferConfig, RolloutConfig

    svc = BufferService(
        BufferParts(
            buffer=BufferConfig(redis_url=redis_url, claim_poll_ms=5),
            rollout=RolloutConfig(
                consumer_batch_size=2, max_head_offpolicyness=1000, max_concurrent_rollouts=4
            ),
            prefix="outagetest",
            export_dir=str(tmp_path / "exports"),
            port=port,
        )
    )
    await svc.start()
    return svc


def _gated_loop(engine: TorchEngine, buffer: Any, max_concurrent: int) -> Any:
    workflow = GatedWorkflow()
    loop = RolloutLoop(
        engine=engine,
        workflow=workflow,
        dataset=tiny_dataset(engine, n=8),
        buffer=buffer,
        rollout_id="rollout-0",
        max_concurrent=max_concurrent,
        put_retries=0,  # the client's own retries only
    )
    return loop, workflow


async def _drain(loop: RolloutLoop, workflow: GatedWorkflow) -> None:
    """Drain, letting the episodes started meanwhile finish and be put."""
    drain = asyncio.create_task(loop.drain(timeout=60))
    workflow.let_through(8)
    await drain


async def _until(cond: Any, what: str, deadline_s: float = 120.0) -> None:
    """Poll `cond` (a guard against a hang, not a timing assertion)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while not await cond():
        assert loop.time() < end, f"never: {what}"
        await asyncio.sleep(0.05)


@pytest.mark.integration
@pytest.mark.slow
async def test_reservations_left_by_an_outage_longer_than_the_budget_come_back(
    redis_server: Any, engine: TorchEngine, tmp_path: Path
) -> None:
    """Compose defect 4: the buffer is down while two episodes finish; their puts and
    releases fail (a 0.5 s budget here, minutes by default). On today's code the two
    reservations stay in Redis for buffer.reservation_timeout_s (1800 s), so `running`
    stays 2 above the groups actually in flight. Now they are released once the buffer
    answers, and the capacity formula counts exactly the groups in flight."""
    from services.buffer.client import BufferClient

    svc = await _buffer(redis_server.url, tmp_path)
    port = svc.port
    buffer = BufferClient(svc.address, outage_budget_s=0.5)
    observer = BufferClient(svc.address)
    loop, workflow = _gated_loop(engine, buffer, max_concurrent=2)

    async def running_is(n: int) -> bool:
        return (await observer.stats()).running == n

    try:
        loop.start()
        await _until(lambda: running_is(2), "two reservations held")
        assert loop.stats.groups_started == 2
        await svc.stop(grace=0.5)
        workflow.let_through(2)  # both episodes put now: nothing listens

        async def both_failed() -> bool:
            return loop.stats.rejected.get("put_failed", 0) == 2

        await _until(both_failed, "both puts failed")
        svc = await _buffer(redis_server.url, tmp_path, port=port)  # the restarted buffer

        # The loop reserves for two new episodes (blocked on tickets) and gives the two
        # held reservations back: exactly the groups in flight are reserved.
        async def settled() -> bool:
            return (
                loop.stats.groups_started == 4
                and loop.unreleased_reservations == 0
                and await running_is(2)
            )

        await _until(settled, "reserved groups == groups in flight")
        assert loop.groups_in_flight == 2
        s = await observer.stats()
        assert s.reservations_expired_total == 0  # released, not expired
        assert (s.put_total, s.capacity) == (0, 2)  # capacity = min(4 - 2, ...) = 2
        workflow.let_through(2)

        async def produced() -> bool:
            return loop.stats.groups_produced == 2

        await _until(produced, "the two new groups stored")
        await _drain(loop, workflow)
        s = await observer.stats()
        assert s.invariant_ok and s.running == 0
        assert s.put_total == loop.stats.groups_produced >= 2
    finally:
        for c in (buffer, observer):
            await c.close()
        await svc.stop(grace=0.5)


@pytest.mark.integration
@pytest.mark.slow
async def test_a_put_made_while_the_buffer_restarts_is_stored_once_it_is_back(
    redis_server: Any, engine: TorchEngine, tmp_path: Path
) -> None:
    """rollout -> buffer: an outage within the budget costs waiting, not the group. The
    buffer is down for 5 s, longer than the old client's fixed 5 retries (at most 3.1 s of
    back-off); the put started during the outage is admitted by the restarted buffer, its
    reservation is fulfilled (running back to 0) and the outage is exported."""
    from prometheus_client import CollectorRegistry

    from services.buffer.client import BufferClient
    from services.common.outage import PeerOutageMetrics

    svc = await _buffer(redis_server.url, tmp_path)
    port = svc.port
    registry = CollectorRegistry()
    peer = PeerOutageMetrics("rollout", registry).peer("buffer", svc.address)
    buffer = BufferClient(svc.address, peer=peer)  # the default budget: minutes
    observer = BufferClient(svc.address)
    loop, workflow = _gated_loop(engine, buffer, max_concurrent=1)

    async def one_reserved() -> bool:
        return (await observer.stats()).running == 1

    try:
        loop.start()
        await _until(one_reserved, "one reservation held")
        await svc.stop(grace=0.5)
        workflow.let_through(1)

        async def buffer_down() -> bool:
            return peer.down

        await _until(buffer_down, "the put met the dead buffer")
        # The outage lasts 5 s; the put waits through it, it does not give up.
        await holds(lambda: loop.stats.rejected == {}, "nothing rejected", hold_s=5.0)
        svc = await _buffer(redis_server.url, tmp_path, port=port)

        async def produced() -> bool:
            return loop.stats.groups_produced == 1

        await _until(produced, "the group stored")
        await _drain(loop, workflow)
        s = await observer.stats()
        # Stored once (the retries carried the same group id), nothing lost or rejected.
        assert s.put_total == s.admitted_total == loop.stats.groups_produced >= 1
        assert s.duplicate_total == 0 and s.running == 0 and s.invariant_ok
        assert loop.stats.rejected == {}
    finally:
        for c in (buffer, observer):
            await c.close()
        await svc.stop(grace=0.5)
    seconds = registry.get_sample_value(
        "flywheel_rollout_peer_unavailable_seconds_total", {"peer": "buffer"}
    )
    assert seconds is not None and seconds > 0
    assert registry.get_sample_value("flywheel_rollout_peer_unavailable", {"peer": "buffer"}) == 0


# ------------------------------- integration: new weights while the buffer holds a Reserve


@pytest.mark.integration
async def test_new_weights_reask_a_held_reserve_with_the_new_served_version(
    redis_server: Any, engine: TorchEngine, tmp_path: Path
) -> None:
    """A replica serving version 0 under eta = 0 fills its budget (2 groups) and its next
    Reserve is held. The trainer publishes version 1 and the replica loads it: the budget
    of version 1 counts only for a replica that says it serves version 1, so the held call
    (which says 0) would wait out its whole hold (10 minutes here). The loop asks again
    under the same request id with the new version and is granted at once; nothing is
    granted twice and nothing leaks."""
    from services.buffer.client import BufferClient
    from services.buffer.service import BufferParts, BufferService
    from services.common.config import BufferConfig, RolloutConfig
    from services.common.weights.manifest import make_manifest

    svc = BufferService(
        BufferParts(
            buffer=BufferConfig(redis_url=redis_server.url, claim_poll_ms=5),
            rollout=RolloutConfig(
                consumer_batch_size=2, max_head_offpolicyness=0, max_concurrent_rollouts=16
            ),
            prefix="reasktest",
            export_dir=str(tmp_path / "exports"),
        )
    )
    await svc.start()
    buffer, trainer_side = BufferClient(svc.address), BufferClient(svc.address)
    workflow = GatedWorkflow()
    loop = RolloutLoop(
        engine=engine,
        workflow=workflow,
        dataset=tiny_dataset(engine, n=8),
        buffer=buffer,
        rollout_id="rollout-0",
        max_concurrent=4,
        reserve_wait_ms=600_000,
    )
    try:
        loop.start()
        await until(lambda: loop.stats.groups_started == 2, "version 0's budget granted")
        await trainer_side.set_version(1)
        weights = engine.current_weights()
        assert (await engine.update_weights_from_tensors(weights, make_manifest(weights, 1))).ok
        loop.weights_changed()
        await until(lambda: loop.stats.groups_started == 4, "version 1's budget granted")
        assert loop.stats.reserves_reissued >= 1
        s = await trainer_side.stats()
        assert (s.running, s.capacity) == (4, 0)  # (eta + 1 + 1) * 2 = 4, each granted once
        drain = asyncio.create_task(loop.drain(timeout=60))
        workflow.let_through(8)
        await drain
        s = await trainer_side.stats()
        assert s.invariant_ok and s.running == 0
        assert s.put_total == 4  # each reservation fulfilled once (the gated episodes'
        # tokens say version 0, so at eta 0 the buffer drops them as stale: counted, kept out)
    finally:
        for c in (buffer, trainer_side):
            await c.close()
        await svc.stop(grace=0.5)
