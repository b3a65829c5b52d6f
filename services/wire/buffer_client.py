"""`BufferClient`: the typed async client the rollout and trainer use to talk to the buffer.

Every state-changing call carries a `request_id` generated once per logical call and reused
on each retry, so retrying after a lost answer is harmless (the buffer deduplicates puts by
group id and answers Claim/ReserveCapacity/SetVersion retries from a short-lived record;
Release and Ack are idempotent by reservation and group id). So every call is retried on an
outage (UNAVAILABLE, DEADLINE_EXCEEDED: the buffer restarting, or Redis behind it) with
bounded back-off for up to `outage_budget_s` (minutes by default: a call made while the
buffer or Redis restarts succeeds once it is back); a full buffer (RESOURCE_EXHAUSTED with a
`retry-after-ms` trailer) is waited out for up to `backpressure_wait_s`; everything else is
raised at once as a typed error. The outage is reported to the client's `PeerHealth`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from flywheel_proto.v1 import buffer_pb2, buffer_pb2_grpc, common_pb2
from services.common.codec import CodecLimits, group_from_proto, group_to_proto
from services.common.config.services import TLSConfig
from services.common.grpc_client import (
    BACKOFF_CAP_S,
    DEFAULT_OUTAGE_BUDGET_S,
    OUTAGE,
    RetryingClient,
    make_channel,
)
from services.common.outage import PeerHealth
from services.core.errors import InvalidGroupError
from services.core.types import TrajectoryGroup
from services.wire import buffer_envelopes

T = TypeVar("T")

_RESULT_NAMES = {
    buffer_pb2.ADMISSION_RESULT_ADMITTED: "admitted",
    buffer_pb2.ADMISSION_RESULT_DUPLICATE: "duplicate",
    buffer_pb2.ADMISSION_RESULT_STALE: "stale",
    buffer_pb2.ADMISSION_RESULT_FILTERED: "filtered",
    buffer_pb2.ADMISSION_RESULT_INVALID: "invalid",
    buffer_pb2.ADMISSION_RESULT_FULL: "full",
}


class BufferClientError(Exception):
    """Base of the errors this client raises on purpose (others are grpc.RpcError)."""


class BufferFullError(BufferClientError):
    """The buffer stayed full for longer than `backpressure_wait_s`."""


class VersionRegressionError(BufferClientError, ValueError):
    """SetVersion with a version below the buffer's current one; `current` holds it."""

    def __init__(self, message: str, current: int) -> None:
        super().__init__(message)
        self.current = current


@dataclass(frozen=True)
class PutResult:
    """`result` is admitted, duplicate (already put; nothing stored again), stale or filtered."""

    result: str
    reason: str
    version: int

    @property
    def stored(self) -> bool:
        """True when the group is (or already was) in the buffer for a trainer."""
        return self.result in ("admitted", "duplicate")


@dataclass(frozen=True)
class Reservation:
    reservation_ids: list[str]
    version: int
    capacity: int
    retry_after_ms: int


@dataclass(frozen=True)
class CapacityInfo:
    capacity: int
    version: int
    running: int
    accepted: int


@dataclass
class ClaimResult:
    """Claimed groups as received; `groups` decodes (and validates) them on first use, so a
    caller that only forwards or counts them pays no decoding."""

    messages: list[common_pb2.TrajectoryGroup]
    version: int
    dropped_stale: int
    codec_limits: CodecLimits = field(default_factory=CodecLimits, repr=False)
    _decoded: list[TrajectoryGroup] | None = field(default=None, repr=False)

    @property
    def groups(self) -> list[TrajectoryGroup]:
        if self._decoded is None:
            self._decoded = [group_from_proto(m, self.codec_limits) for m in self.messages]
        return self._decoded

    @property
    def group_ids(self) -> list[str]:
        return [m.group_id for m in self.messages]

    def __len__(self) -> int:
        return len(self.messages)


AnyGroup = TrajectoryGroup | common_pb2.TrajectoryGroup | bytes
"""A group to put: decoded, as a message, or already serialized (a TrajectoryGroup's bytes)."""


def _group_bytes(group: AnyGroup) -> bytes:
    if isinstance(group, bytes):
        return group
    msg = group if isinstance(group, common_pb2.TrajectoryGroup) else group_to_proto(group)
    return msg.SerializeToString()


def _method_path(name: str) -> str:
    service = buffer_pb2.DESCRIPTOR.services_by_name["BufferService"]
    return f"/{service.full_name}/{service.methods_by_name[name].name}"


def _trailer(err: grpc.RpcError, key: str) -> str | None:
    try:
        trailers = err.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 - errors raised before a call exist carry none
        return None
    for k, v in trailers:
        if k == key:
            return v.decode() if isinstance(v, bytes) else str(v)
    return None


class BufferClient(RetryingClient):
    """Async client of `flywheel.v1.BufferService`; use as `async with BufferClient(addr) as c`.

    `timeout` is the deadline of one attempt; an outage is retried for `outage_budget_s`
    seconds (and at most `retries` times when that is set; 0 turns retries off); `peer`
    receives the outcome of every attempt (default: a `PeerHealth` of its own, unexported).
    """

    def __init__(
        self,
        address: str,
        *,
        auth_token: str | None = None,
        max_message_bytes: int = 64 << 20,
        timeout: float = 30.0,
        retries: int | None = None,
        outage_budget_s: float = DEFAULT_OUTAGE_BUDGET_S,
        backpressure_wait_s: float = 300.0,
        codec_limits: CodecLimits = CodecLimits(),
        peer: PeerHealth | None = None,
        tls: TLSConfig | None = None,
    ) -> None:
        self._retry_settings("buffer", address, timeout, retries, outage_budget_s, peer)
        self.channel = make_channel(
            address, max_message_bytes=max_message_bytes, auth_token=auth_token, tls=tls
        )
        self.stub = buffer_pb2_grpc.BufferServiceStub(self.channel)
        # The puts send hand-written wire bytes (see services/wire/buffer_envelopes.py).
        self._put_wire = self.channel.unary_unary(
            _method_path("Put"),
            request_serializer=None,
            response_deserializer=buffer_pb2.PutResponse.FromString,
        )
        self._put_many_wire = self.channel.unary_unary(
            _method_path("PutMany"),
            request_serializer=None,
            response_deserializer=buffer_pb2.PutManyResponse.FromString,
        )
        self.backpressure_wait_s = backpressure_wait_s
        self.codec_limits = codec_limits

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> BufferClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(
        self,
        method: Callable[..., Awaitable[T]],
        request: Any,
        *,
        timeout: float | None = None,
    ) -> T:
        """One logical call: rides through an outage and waits out backpressure."""
        backpressure_deadline = time.monotonic() + self.backpressure_wait_s
        while True:
            try:
                return await self._retrying(method, request, timeout=timeout, retry_codes=OUTAGE)
            except grpc.RpcError as err:
                hint = (
                    _trailer(err, "retry-after-ms")
                    if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    else None
                )
                if hint is None:  # not backpressure (a group too large cannot fit later)
                    raise
                wait = int(hint) / 1000.0
                if time.monotonic() + wait > backpressure_deadline:
                    raise BufferFullError(
                        f"buffer at {self.address} still full after {self.backpressure_wait_s}s: "
                        f"{err.details()}"
                    ) from err
                await asyncio.sleep(wait)

    def longest_call_s(self, attempt_timeout: float | None = None) -> float:
        """How long one call can take through an outage (backpressure waits aside): the
        budget, one more attempt at its deadline, one back-off. For callers that guard a
        call with a deadline of their own (the trainer's rank 0)."""
        return self.outage_budget_s + (attempt_timeout or self.timeout) + BACKOFF_CAP_S

    @staticmethod
    def _rid(request_id: str | None) -> str:
        return request_id or uuid.uuid4().hex

    # -- rollout side ----------------------------------------------------------------------
    async def put(self, group: AnyGroup, *, request_id: str | None = None) -> PutResult:
        """Store one group. Raises InvalidGroupError (malformed/oversized, nothing stored)
        and BufferFullError (backpressure lasted too long)."""
        req = buffer_envelopes.encode_put_request(self._rid(request_id), _group_bytes(group))
        try:
            resp = await self._call(self._put_wire, req)
        except grpc.RpcError as err:
            if err.code() in (
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            ):
                raise InvalidGroupError(err.details()) from err
            raise
        return PutResult(_RESULT_NAMES.get(resp.result, "unspecified"), resp.reason, resp.version)

    async def put_many(
        self, groups: Sequence[AnyGroup], *, request_id: str | None = None
    ) -> list[PutResult]:
        """Store several groups in one call; one result per group, in order. Unlike `put`,
        a malformed group does not raise: its result is `invalid` (counted, nothing stored)
        and the others are stored. Groups refused because the buffer is full are sent again
        after the buffer's retry-after hint until `backpressure_wait_s`, then BufferFullError."""
        rid = self._rid(request_id)
        puts = [(f"{rid}-{i}", _group_bytes(g)) for i, g in enumerate(groups)]
        results: list[PutResult | None] = [None] * len(puts)
        todo = list(range(len(puts)))
        deadline = time.monotonic() + self.backpressure_wait_s
        while todo:
            req = buffer_envelopes.encode_put_many([puts[i] for i in todo])
            resp = await self._call(self._put_many_wire, req)
            full: list[int] = []
            wait_ms = 0
            for i, r in zip(todo, resp.results, strict=True):
                if r.result == buffer_pb2.ADMISSION_RESULT_FULL:
                    full.append(i)
                    wait_ms = max(wait_ms, r.retry_after_ms)
                else:
                    name = _RESULT_NAMES.get(r.result, "unspecified")
                    results[i] = PutResult(name, r.reason, r.version)
            if full and time.monotonic() + wait_ms / 1000.0 > deadline:
                raise BufferFullError(
                    f"buffer at {self.address} still full after {self.backpressure_wait_s}s: "
                    f"{len(full)} of {len(puts)} groups not stored"
                )
            if full:
                await asyncio.sleep(wait_ms / 1000.0)
            todo = full
        return [r for r in results if r is not None]

    async def reserve(
        self,
        count: int,
        *,
        rollout_id: str = "",
        request_id: str | None = None,
        served_version: int | None = None,
        wait_ms: int = 0,
    ) -> Reservation:
        """Ask for capacity for `count` groups; may grant fewer, possibly none.
        `served_version`: the version the asking replica serves (capacity then counts from
        the older of it and the buffer's version). `wait_ms`: with nothing to grant now, the
        buffer holds the call up to this long and grants as soon as capacity frees."""
        req = buffer_pb2.ReserveCapacityRequest(
            request_id=self._rid(request_id),
            rollout_id=rollout_id,
            count=count,
            served_version=served_version,
            wait_ms=wait_ms,
        )
        r = await self._call(
            self.stub.ReserveCapacity, req, timeout=self.timeout + wait_ms / 1000.0
        )
        return Reservation(list(r.reservation_ids), r.version, r.capacity, r.retry_after_ms)

    async def release(
        self,
        reservation_ids: Sequence[str],
        *,
        request_id: str | None = None,
        rollout_id: str = "",
    ) -> int:
        """Give back reservations that will not be fulfilled; returns how many were held.
        With no ids and a `rollout_id`, every reservation of that replica is released."""
        req = buffer_pb2.ReleaseCapacityRequest(
            request_id=self._rid(request_id),
            reservation_ids=list(reservation_ids),
            rollout_id=rollout_id,
        )
        return (await self._call(self.stub.ReleaseCapacity, req)).released

    async def capacity(self) -> CapacityInfo:
        r = await self._call(self.stub.GetCapacity, common_pb2.Empty())
        return CapacityInfo(r.capacity, r.version, r.running, r.accepted)

    # -- trainer side ----------------------------------------------------------------------
    async def claim(
        self,
        n_groups: int,
        *,
        consumer_id: str,
        wait_ms: int = 0,
        allow_partial: bool = False,
        request_id: str | None = None,
    ) -> ClaimResult:
        """Whole groups, oldest version first; none unless all n arrive within `wait_ms`
        (or fewer at the end of the wait with `allow_partial`). Ack them after the
        optimizer step that used them, or they are redelivered after `buffer.claim_idle_ms`."""
        req = buffer_pb2.ClaimRequest(
            request_id=self._rid(request_id),
            consumer_id=consumer_id,
            n_groups=n_groups,
            wait_ms=wait_ms,
            allow_partial=allow_partial,
        )
        r = await self._call(self.stub.Claim, req, timeout=self.timeout + wait_ms / 1000.0)
        return ClaimResult(list(r.groups), r.version, r.dropped_stale, self.codec_limits)

    async def ack(
        self, group_ids: Sequence[str], *, consumer_id: str = "", request_id: str | None = None
    ) -> int:
        """Forget claimed groups; returns how many were newly acknowledged (retries: 0)."""
        req = buffer_pb2.AckRequest(
            request_id=self._rid(request_id), consumer_id=consumer_id, group_ids=list(group_ids)
        )
        return (await self._call(self.stub.Ack, req)).acked

    async def set_version(self, version: int, *, request_id: str | None = None) -> int:
        """Move the version forward; raises VersionRegressionError for a lower one."""
        req = buffer_pb2.SetVersionRequest(request_id=self._rid(request_id), version=version)
        try:
            return (await self._call(self.stub.SetVersion, req)).version
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                current = await self.get_version()
                raise VersionRegressionError(err.details(), current) from err
            raise

    async def get_version(self) -> int:
        return (await self._call(self.stub.GetVersion, common_pb2.Empty())).version

    # -- inspection ------------------------------------------------------------------------
    async def stats(self) -> buffer_pb2.BufferStats:
        """Counters and the accounting invariant (`invariant_ok`)."""
        return await self._call(self.stub.Stats, common_pb2.Empty())

    async def list_groups(
        self, min_version: int = 0, max_version: int = -1, limit: int = 1000
    ) -> list[buffer_pb2.GroupSummary]:
        req = buffer_pb2.ListGroupsRequest(
            min_version=min_version, max_version=max_version, limit=limit
        )
        return list((await self._call(self.stub.ListGroups, req)).groups)

    async def read_group(self, group_id: str) -> TrajectoryGroup:
        msg = await self._call(self.stub.ReadGroup, buffer_pb2.ReadGroupRequest(group_id=group_id))
        return group_from_proto(msg, self.codec_limits)

    async def export(
        self, path: str, min_version: int = 0, max_version: int = -1
    ) -> tuple[int, str]:
        """Export to `path` inside the buffer's export_dir; returns (groups, absolute path)."""
        req = buffer_pb2.ExportRequest(min_version=min_version, max_version=max_version, path=path)
        r = await self._call(self.stub.Export, req, timeout=max(self.timeout, 600.0))
        return r.groups, r.path
