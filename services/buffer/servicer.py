"""The gRPC face of the buffer: validation, status codes, waiting; state lives in the store.

Every RPC answers with a status, never a crash: bad input is INVALID_ARGUMENT naming the
field, a full buffer is RESOURCE_EXHAUSTED with a `retry-after-ms` trailer, an unreachable
Redis is UNAVAILABLE (and the health monitor turns the service NOT_SERVING until Redis is
back); how a failure becomes a status is `rpc_handlers.py`'s. What a request must satisfy to be admitted is `admission.py`'s; this module
translates between it, the store and the wire.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc

from flywheel_proto.v1 import buffer_pb2, buffer_pb2_grpc, common_pb2
from services.buffer.admission import (
    Admission,
    BoundsRefusal,
    RpcFailure,
    check_ids,
    full_reason,
    require,
)
from services.buffer.export import export_jsonl
from services.buffer.metrics import BufferMetrics
from services.buffer.payload_cache import PayloadCache
from services.buffer.rpc_handlers import parse_request, register, rpc
from services.buffer.store import ClaimedGroup, PutItem, PutOutcome, RedisStore, StatsSnapshot
from services.buffer.validate import (
    MAX_VERSION,
    set_version_problem,
)
from services.common.aio import wait_condition
from services.common.codec import CodecLimits, group_from_proto
from services.core.contracts import GroupFilter
from services.wire import buffer_envelopes

log = logging.getLogger(__name__)

__all__ = ["BufferServicer", "ServicerSettings", "register", "stats_to_proto"]

MAX_IDS_PER_CALL = 100_000
MAX_PUTS_PER_CALL = 1024
MAX_WAIT_MS = 600_000


@dataclass(frozen=True)
class ServicerSettings:
    max_group_bytes: int = 64 << 20
    codec_limits: CodecLimits = CodecLimits()
    retry_after_ms: int = 500
    claim_poll_ms: int = 25
    export_dir: str = "/tmp/flywheel/buffer_exports"
    filter_name: str = ""
    filter_at: str = "put"
    max_head_offpolicyness: int = 0
    replay: bool = False
    tokenizer_path: str | None = None
    read_cache_bytes: int = 0
    max_resume_version: int = MAX_VERSION  # see validate.max_resume_version


class BufferServicer(buffer_pb2_grpc.BufferServiceServicer):
    """Implements `flywheel.v1.BufferService` over a `RedisStore`."""

    def __init__(
        self,
        store: RedisStore,
        metrics: BufferMetrics,
        settings: ServicerSettings,
        group_filter: GroupFilter | None = None,
        on_redis_error: Callable[[BaseException], None] = lambda err: None,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.settings = settings
        self.group_filter = group_filter
        self.on_redis_error = on_redis_error
        self.admission = Admission(
            store,
            metrics,
            max_group_bytes=settings.max_group_bytes,
            codec_limits=settings.codec_limits,
            filter_name=settings.filter_name,
            filter_at=settings.filter_at,
            max_head_offpolicyness=settings.max_head_offpolicyness,
            group_filter=group_filter,
        )
        self._arrivals = asyncio.Condition()
        self._capacity_freed = asyncio.Condition()
        self._max_put_seen = 0
        self.lost_puts_detected = 0  # by this process; Stats reports the total kept in Redis
        self._lost_unsaved = 0  # detected, not yet added to Redis's count (it failed again)
        self._snapshot_lock = asyncio.Lock()
        # A replay buffer takes no puts: nothing would ever be found in a cache.
        self.cache = PayloadCache(0 if settings.replay else settings.read_cache_bytes)
        metrics.read_cache_bytes.set_function(lambda: self.cache.bytes)  # read at scrape

    # -- helpers -------------------------------------------------------------------------
    async def _notify_arrival(self) -> None:
        async with self._arrivals:
            self._arrivals.notify_all()

    async def _wait_arrival(self, timeout: float) -> None:
        async with self._arrivals:
            await wait_condition(self._arrivals, timeout)

    async def _notify_capacity(self) -> None:
        """Something that can raise the rollout's capacity happened through this replica: a
        claim (the queue term), a version bump (the staleness term), a release, a group
        dropped. Admitted puts and acks leave capacity as it was and wake nobody."""
        async with self._capacity_freed:
            self._capacity_freed.notify_all()

    async def _wait_capacity(self, timeout: float) -> None:
        async with self._capacity_freed:
            await wait_condition(self._capacity_freed, timeout)

    def _refuse_in_replay(self, what: str) -> None:
        if self.settings.replay:
            raise RpcFailure(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{what} refused: this buffer replays an exported file (buffer.replay_path is "
                "set) and serves only Claim, Ack, versions, stats and inspection",
            )

    async def snapshot(self) -> StatsSnapshot:
        """Take and observe one accounting snapshot. Serialised, so snapshots are observed
        in the order Redis took them and a counter never seems to go back when it did not."""
        async with self._snapshot_lock:
            snap = await self.store.stats()
            self._lost_unsaved += self.observe_stats(snap)
            if self._lost_unsaved:  # counted in Redis: the total survives a buffer restart
                snap.extra["lost_puts"] = await self.store.count_lost_puts(self._lost_unsaved)
                self._lost_unsaved = 0
            return snap

    def observe_stats(self, snap: StatsSnapshot) -> int:
        """Feed metrics and notice a Redis that lost acknowledged puts (counter went back);
        returns how many it lost since the last snapshot."""
        lost = 0
        if snap.put < self._max_put_seen:
            lost = self._max_put_seen - snap.put
            self.metrics.lost_puts.inc(lost)
            self.lost_puts_detected += lost
            log.error(
                "redis lost acknowledged puts",
                extra={"put_before": self._max_put_seen, "put_now": snap.put, "lost": lost},
            )
        self._max_put_seen = snap.put
        self.metrics.snapshot.update(snap)
        return lost

    # -- Put -----------------------------------------------------------------------------
    @rpc
    async def Put(self, request: bytes, context: Any) -> buffer_pb2.PutResponse:
        self._refuse_in_replay("Put")
        put = parse_request(buffer_pb2.PutRequest, request)
        item = await self.admission.admissible(
            put, buffer_envelopes.put_group_bytes(memoryview(request))
        )
        outcome = (await self._store_puts([item]))[0]
        if outcome.result == "full":
            raise RpcFailure(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                full_reason(outcome),
                retry_after_ms=self.settings.retry_after_ms,
            )
        return self.admission.put_response(put.group.group_id, item.oldest_version, outcome)

    @rpc
    async def PutMany(self, request: bytes, context: Any) -> buffer_pb2.PutManyResponse:
        self._refuse_in_replay("PutMany")
        parsed = parse_request(buffer_pb2.PutManyRequest, request)
        n = len(parsed.puts)
        require(0 < n <= MAX_PUTS_PER_CALL, "puts", f"must hold 1 to {MAX_PUTS_PER_CALL}")
        ids = [p.group.group_id for p in parsed.puts]
        require(len(set(ids)) == n, "puts", "group ids must be distinct within one call")
        results: list[buffer_pb2.PutResponse | None] = [None] * n
        items: list[PutItem] = []
        where: list[int] = []
        raw = buffer_envelopes.put_many_group_bytes(request)
        for i, (put, payload) in enumerate(zip(parsed.puts, raw, strict=True)):
            try:
                items.append(await self.admission.admissible(put, payload))
                where.append(i)
            except RpcFailure as err:
                if err.code == grpc.StatusCode.INTERNAL:  # a filter broke: store nothing
                    raise
                if isinstance(err, BoundsRefusal):
                    self.metrics.refused.labels("PutMany", err.field).inc()
                # Counted as invalid by admissible(); the others still go in.
                results[i] = buffer_pb2.PutResponse(
                    result=buffer_pb2.ADMISSION_RESULT_INVALID, reason=err.details
                )
        for i, item, outcome in zip(where, items, await self._store_puts(items), strict=True):
            if outcome.result == "full":
                results[i] = buffer_pb2.PutResponse(
                    result=buffer_pb2.ADMISSION_RESULT_FULL,
                    reason=full_reason(outcome),
                    version=outcome.version,
                    retry_after_ms=self.settings.retry_after_ms,
                )
            else:
                results[i] = self.admission.put_response(
                    item.group_id, item.oldest_version, outcome
                )
        answered = [r for r in results if r is not None]
        assert len(answered) == n  # every put was refused above or stored just now
        return buffer_pb2.PutManyResponse(results=answered)

    async def _store_puts(self, items: list[PutItem]) -> list[PutOutcome]:
        outcomes = await self.store.put_many(items)
        for item, outcome in zip(items, outcomes, strict=True):
            self.admission.note_version(outcome.version)
            self.metrics.put_results.labels(outcome.result).inc()
            if outcome.result == "full":
                self.metrics.backpressure.inc()
            elif outcome.result == "admitted" and self.cache.enabled:
                self.cache.add(item.group_id, outcome.member, item.payload)
        if any(o.result == "admitted" for o in outcomes):
            await self._notify_arrival()
        if any(o.result in ("stale", "filtered") for o in outcomes):
            await self._notify_capacity()  # their reservations were given back
        return outcomes

    # -- capacity ------------------------------------------------------------------------
    @rpc
    async def ReserveCapacity(
        self, request: buffer_pb2.ReserveCapacityRequest, context: Any
    ) -> buffer_pb2.ReserveCapacityResponse:
        self._refuse_in_replay("ReserveCapacity")
        check_ids(rollout_id=request.rollout_id, request_id=request.request_id)
        require(
            0 <= request.count <= MAX_IDS_PER_CALL, "count", f"must be in [0, {MAX_IDS_PER_CALL}]"
        )
        served = request.served_version if request.HasField("served_version") else None
        require(served is None or served >= 0, "served_version", "must be >= 0")
        require(0 <= request.wait_ms <= MAX_WAIT_MS, "wait_ms", f"must be in [0, {MAX_WAIT_MS}]")
        deadline = time.monotonic() + request.wait_ms / 1000.0
        # Capacity freed through another buffer replica sends no notice here: look again
        # every retry_after_ms while held, as a polling client would have.
        recheck = self.settings.retry_after_ms / 1000.0
        while True:
            out = await self.store.reserve(
                count=request.count,
                rollout_id=request.rollout_id or "rollout",
                request_id=request.request_id,
                served_version=served,
            )
            left = deadline - time.monotonic()
            if out.reservation_ids or request.count == 0 or left <= 0:
                break
            await self._wait_capacity(min(recheck, left))
        return buffer_pb2.ReserveCapacityResponse(
            reservation_ids=out.reservation_ids,
            version=out.version,
            capacity=out.capacity,
            retry_after_ms=0
            if out.reservation_ids or request.wait_ms
            else self.settings.retry_after_ms,
        )

    @rpc
    async def ReleaseCapacity(
        self, request: buffer_pb2.ReleaseCapacityRequest, context: Any
    ) -> buffer_pb2.ReleaseCapacityResponse:
        ids = list(request.reservation_ids)
        require(len(ids) <= MAX_IDS_PER_CALL, "reservation_ids", f"at most {MAX_IDS_PER_CALL}")
        check_ids(reservation_id=ids, rollout_id=request.rollout_id)
        if not ids and request.rollout_id:
            require("#" not in request.rollout_id, "rollout_id", "no '#' in a rollout_id")
            released = await self.store.release_rollout(request.rollout_id)
        else:
            released = await self.store.release(ids)
        if released:
            await self._notify_capacity()
        return buffer_pb2.ReleaseCapacityResponse(released=released)

    @rpc
    async def GetCapacity(
        self, request: common_pb2.Empty, context: Any
    ) -> buffer_pb2.CapacityResponse:
        c = await self.store.capacity()
        return buffer_pb2.CapacityResponse(
            capacity=c.capacity, version=c.version, running=c.running, accepted=c.accepted
        )

    # -- Claim / Ack ---------------------------------------------------------------------
    @rpc
    async def Claim(  # type: ignore[override]  # wire bytes, see rpc_handlers.register
        self, request: buffer_pb2.ClaimRequest, context: Any
    ) -> bytes:
        check_ids(consumer_id=request.consumer_id, request_id=request.request_id)
        require(
            1 <= request.n_groups <= MAX_IDS_PER_CALL,
            "n_groups",
            f"must be in [1, {MAX_IDS_PER_CALL}]",
        )
        require(0 <= request.wait_ms <= MAX_WAIT_MS, "wait_ms", f"must be in [0, {MAX_WAIT_MS}]")
        deadline = time.monotonic() + request.wait_ms / 1000.0
        poll = self.settings.claim_poll_ms / 1000.0
        filtering = self.group_filter is not None and self.settings.filter_at == "claim"
        served: list[ClaimedGroup] = []
        dropped_stale = 0
        version = 0
        while True:
            last_try = time.monotonic() >= deadline
            # Whole batches come atomically from one script: until the wait runs out it hands
            # out all that is missing or nothing. A filter at claim time must look at groups
            # before knowing whether they count, so it collects partially and gives back.
            out = await self.store.claim(
                consumer_id=request.consumer_id,
                n_groups=request.n_groups - len(served),
                allow_partial=filtering or (last_try and request.allow_partial),
                request_id="" if filtering else request.request_id,
                # An empty cache (off, just restarted, or a replica that takes no puts) would
                # miss every group: then the script sends the bytes, in the same round trip.
                with_payloads=len(self.cache) == 0,
            )
            out_groups = await self._with_payloads(out.groups)
            version = out.version
            dropped_stale += out.dropped_stale
            if out.too_big_bytes:
                if served:
                    await self.store.unclaim([g.group_id for g in served], request.consumer_id)
                raise BoundsRefusal(
                    "n_groups",
                    f"{request.n_groups} groups: the next groups hold {out.too_big_bytes} "
                    f"bytes, more than one reply may carry ({self.store.settings.max_reply_bytes});"
                    " claim fewer groups per call",
                    code=grpc.StatusCode.RESOURCE_EXHAUSTED,
                )
            if filtering:
                try:
                    kept = await self._filter_claimed(out_groups)
                except RpcFailure:  # the filter failed: give everything back untouched
                    held = [g.group_id for g in [*served, *out_groups]]
                    await self.store.unclaim(held, request.consumer_id)
                    raise
                served.extend(kept)
            else:
                served.extend(out_groups)
            if out.replayed or len(served) >= request.n_groups or (served and not filtering):
                break
            if filtering and len(out.groups) > 0:
                continue  # some were filtered out: look for replacements at once
            if last_try:
                if served and not request.allow_partial:
                    await self.store.unclaim([g.group_id for g in served], request.consumer_id)
                    served = []
                break
            await self._wait_arrival(max(0.0, min(poll, deadline - time.monotonic())))
        if served or dropped_stale:
            await self._notify_capacity()  # the queue term, or stale groups left `accepted`
        payloads: list[bytes | memoryview] = []
        for g in served:
            self.metrics.served_staleness.observe(max(0, version - g.oldest_version))
            assert g.payload is not None  # filled in by _with_payloads
            payloads.append(g.payload)
        # The stored payloads are serialized TrajectoryGroups already: the reply is written
        # around them instead of parsing and re-serializing megabytes (see `rpc_handlers.register`).
        return buffer_envelopes.encode_claim_response(version, dropped_stale, payloads)

    async def _with_payloads(self, groups: list[ClaimedGroup]) -> list[ClaimedGroup]:
        """Fill in payloads the claim script did not send: from the cache, else from Redis
        (one round trip for all misses). A group whose bytes are gone from Redis as well was
        retired since the script handed it out: redelivered to another consumer and acked
        there, which needs `buffer.claim_idle_ms` shorter than that round trip. It is no
        longer this consumer's to train on, so it is left out (the batch comes short)."""
        if not groups or all(g.payload is not None for g in groups):
            return groups
        found = {g.group_id: self.cache.get(g.group_id, g.member) for g in groups}
        missing = [gid for gid, payload in found.items() if payload is None]
        self.metrics.read_cache.labels("hit").inc(len(groups) - len(missing))
        if missing:
            self.metrics.read_cache.labels("miss").inc(len(missing))
            found.update(zip(missing, await self.store.fetch_payloads(missing), strict=True))
        return [
            replace(g, payload=found[g.group_id]) for g in groups if found[g.group_id] is not None
        ]

    async def _filter_claimed(self, groups: list[ClaimedGroup]) -> list[ClaimedGroup]:
        """Apply the filter to claimed groups; rejected ones are dropped as `filtered`."""
        keep: list[ClaimedGroup] = []
        reject: list[str] = []
        for g in groups:
            assert g.payload is not None  # filled in by _with_payloads
            decoded = group_from_proto(
                common_pb2.TrajectoryGroup.FromString(g.payload), self.settings.codec_limits
            )
            if self.admission.accepts(decoded):
                keep.append(g)
            else:
                reject.append(g.group_id)
        if reject:
            self.cache.discard(reject)
            await self.store.drop_claimed(reject, "filtered")
            await self._notify_capacity()  # dropped groups leave `accepted`
        return keep

    @rpc
    async def Ack(self, request: buffer_pb2.AckRequest, context: Any) -> buffer_pb2.AckResponse:
        ids = list(request.group_ids)
        require(len(ids) <= MAX_IDS_PER_CALL, "group_ids", f"at most {MAX_IDS_PER_CALL}")
        require(all(ids), "group_ids", "must not contain empty ids")
        check_ids(group_id=ids)
        acked = await self.store.ack(ids)
        self.cache.discard(ids)
        return buffer_pb2.AckResponse(acked=acked)

    # -- version -------------------------------------------------------------------------
    @rpc
    async def SetVersion(
        self, request: buffer_pb2.SetVersionRequest, context: Any
    ) -> common_pb2.Version:
        check_ids(request_id=request.request_id)
        current = await self.store.get_version()
        why = set_version_problem(request.version, current, self.settings.max_resume_version)
        if why is not None:
            raise BoundsRefusal("version", why)
        ok, current = await self.store.set_version(request.version, request.request_id)
        self.admission.note_version(current)
        if ok:
            await self._notify_capacity()
        if not ok:
            raise RpcFailure(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"version {request.version} < current version {current}: the version only moves "
                "forward (a resumed trainer should continue from GetVersion)",
            )
        return common_pb2.Version(version=current)

    @rpc
    async def GetVersion(self, request: common_pb2.Empty, context: Any) -> common_pb2.Version:
        return common_pb2.Version(version=await self.store.get_version())

    # -- Stats ---------------------------------------------------------------------------
    @rpc
    async def Stats(self, request: common_pb2.Empty, context: Any) -> buffer_pb2.BufferStats:
        s = await self.snapshot()
        msg = stats_to_proto(s)
        msg.replay = self.settings.replay
        msg.lost_puts_detected = s.extra.get("lost_puts", 0)  # over every life of the buffer
        return msg

    # -- inspection ----------------------------------------------------------------------
    @rpc
    async def ListGroups(
        self, request: buffer_pb2.ListGroupsRequest, context: Any
    ) -> buffer_pb2.ListGroupsResponse:
        lo, hi = _version_range(request.min_version, request.max_version)
        limit = request.limit or 1000
        require(1 <= limit <= MAX_IDS_PER_CALL, "limit", f"must be in [1, {MAX_IDS_PER_CALL}]")
        rows = await self.store.list_groups(lo, hi, limit)
        return buffer_pb2.ListGroupsResponse(
            groups=[
                buffer_pb2.GroupSummary(
                    group_id=r.group_id,
                    oldest_version=r.oldest_version,
                    newest_version=r.newest_version,
                    n_trajectories=r.n_trajectories,
                    state=r.state,
                    reason=r.reason,
                )
                for r in rows
            ]
        )

    @rpc
    async def ReadGroup(
        self, request: buffer_pb2.ReadGroupRequest, context: Any
    ) -> common_pb2.TrajectoryGroup:
        check_ids(group_id=request.group_id)
        payload = await self.store.read_group(request.group_id)
        if payload is None:
            raise RpcFailure(
                grpc.StatusCode.NOT_FOUND,
                f"group {request.group_id!r} is not stored (never put, dropped, or acked "
                "without buffer.retain_acked_groups)",
            )
        return common_pb2.TrajectoryGroup.FromString(payload)

    @rpc
    async def Export(
        self, request: buffer_pb2.ExportRequest, context: Any
    ) -> buffer_pb2.ExportResponse:
        lo, hi = _version_range(request.min_version, request.max_version)
        require(bool(request.path), "path", "must name a file inside buffer.export_dir")
        root = Path(self.settings.export_dir).resolve()
        target = (root / request.path).resolve()
        require(
            target.is_relative_to(root) and target != root,
            "path",
            f"{request.path!r} resolves outside buffer.export_dir ({root})",
        )
        try:
            n = await export_jsonl(self.store, lo, hi, target, self.settings.tokenizer_path)
        except OSError as err:
            raise RpcFailure(
                grpc.StatusCode.FAILED_PRECONDITION, f"path: cannot write {target}: {err}"
            ) from None
        return buffer_pb2.ExportResponse(groups=n, path=str(target))


def _version_range(lo: int, hi: int) -> tuple[int, int]:
    """max_version < 0 means no upper bound."""
    hi = (1 << 62) if hi < 0 else hi
    require(lo <= hi, "max_version", f"{hi} is below min_version {lo}")
    return lo, hi


def stats_to_proto(s: StatsSnapshot) -> buffer_pb2.BufferStats:
    return buffer_pb2.BufferStats(
        version=s.version,
        put_total=s.put,
        acked_total=s.acked,
        dropped_total=s.dropped,
        pending=s.pending,
        in_flight=s.in_flight,
        stored_groups=s.stored_groups,
        stored_bytes=s.stored_bytes,
        capacity=s.capacity,
        running=s.running,
        accepted=s.accepted,
        duplicate_total=s.duplicate,
        invariant_ok=s.invariant_ok,
        redelivered_total=s.redelivered,
        admitted_total=s.admitted,
        claimed_total=s.claimed,
        reservations_expired_total=s.reservations_expired,
        retained_groups=s.retained,
    )
