"""The buffer's admission rules: what a put, or any request, must satisfy before the store
sees it, and the refusals that say why not.

Kept apart from the gRPC adapter (`servicer.py`) because they are the buffer's policy, not its
wire: a group is admitted only whole and decodable, within `buffer.max_group_bytes`, with
tokens from versions no further ahead than current + eta + 1, and past `buffer.filter` when
the filter runs at put. Every refused put is still counted, once, as dropped{invalid}, so the
accounting invariant covers everything a producer ever sent; the store decides the rest
(duplicate, stale, full) atomically.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import grpc

from flywheel_proto.v1 import buffer_pb2
from services.buffer.metrics import BufferMetrics
from services.buffer.store import PutItem, PutOutcome, RedisStore
from services.buffer.validate import fast_versions, id_problem, put_version_problem
from services.common.codec import CodecError, CodecLimits, group_from_proto
from services.core.contracts import GroupFilter

log = logging.getLogger(__name__)

_RESULTS = {
    "admitted": buffer_pb2.ADMISSION_RESULT_ADMITTED,
    "duplicate": buffer_pb2.ADMISSION_RESULT_DUPLICATE,
    "stale": buffer_pb2.ADMISSION_RESULT_STALE,
    "filtered": buffer_pb2.ADMISSION_RESULT_FILTERED,
}
_OPTIONAL_IDS = frozenset({"request_id", "reservation_id", "rollout_id"})


class RpcFailure(Exception):
    """Raised inside a handler to answer with a status (turned into context.abort)."""

    def __init__(self, code: grpc.StatusCode, details: str, retry_after_ms: int = 0) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.retry_after_ms = retry_after_ms


class BoundsRefusal(RpcFailure):
    """A request refused by one of the buffer's bounds (ids, versions, counts per call,
    Claim's size and wait), INVALID_ARGUMENT unless `code` says otherwise; every one is
    counted in `flywheel_buffer_refused_requests_total{method,field}`."""

    def __init__(
        self, field: str, why: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT
    ) -> None:
        super().__init__(code, f"{field}: {why}")
        self.field = field


def require(ok: bool, field: str, why: str) -> None:
    """Refuse the request (INVALID_ARGUMENT, counted) when a bound on `field` fails."""
    if not ok:
        raise BoundsRefusal(field, why)


def check_ids(**ids: str | list[str]) -> None:
    """Raise BoundsRefusal for the first id that is not one (see `validate.id_problem`).
    Request, reservation and rollout ids may be empty (they are optional)."""
    for field, value in ids.items():
        for one in value if isinstance(value, list) else [value]:
            why = id_problem(one, allow_empty=field in _OPTIONAL_IDS)
            if why is not None:
                raise BoundsRefusal(field, f"{one[:64]!r} {why}")


def full_reason(outcome: PutOutcome) -> str:
    return (
        f"buffer full: {outcome.stored_groups} groups / {outcome.stored_bytes} bytes "
        "stored (limits buffer.max_stored_groups, buffer.max_stored_bytes); retry later"
    )


@dataclass
class Admission:
    """Checks puts against the rules above; one per servicer."""

    store: RedisStore
    metrics: BufferMetrics
    max_group_bytes: int
    codec_limits: CodecLimits
    filter_name: str
    filter_at: str
    max_head_offpolicyness: int
    group_filter: GroupFilter | None = None
    version_seen: int = 0
    """A lower bound of the current version (it only grows)."""

    def note_version(self, version: int) -> None:
        self.version_seen = max(self.version_seen, version)

    async def count_invalid(self, request: buffer_pb2.PutRequest) -> None:
        await self.store.put_invalid(
            group_id=request.group.group_id,
            request_id=request.request_id,
            reservation_id=request.group.reservation_id,
        )
        self.metrics.put_results.labels("invalid").inc()

    async def admissible(
        self, request: buffer_pb2.PutRequest, payload: bytes | memoryview | None
    ) -> PutItem:
        """The group as the store takes it, or RpcFailure (counted as invalid) saying why not.
        `payload` is the group's bytes as received (None: serialize the parsed group)."""
        msg = request.group
        try:
            # Empty group and trajectory ids are left to the codec, which names them.
            check_ids(
                group_id=[msg.group_id] if msg.group_id else [],
                request_id=request.request_id,
                reservation_id=msg.reservation_id,
                trajectory_id=[t.trajectory_id for t in msg.trajectories if t.trajectory_id],
            )
        except BoundsRefusal:
            # Counted (put and dropped{invalid}) under no id: a bad id must not become a key.
            await self.store.put_invalid()
            self.metrics.put_results.labels("invalid").inc()
            raise
        if payload is None:
            payload = msg.SerializeToString()
        size = len(payload)
        if size > self.max_group_bytes:
            await self.count_invalid(request)
            raise RpcFailure(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"group {msg.group_id!r} is {size} bytes, above buffer.max_group_bytes="
                f"{self.max_group_bytes}; it was dropped as invalid and a retry "
                "cannot succeed",
            )
        filtering = self.group_filter is not None and self.filter_at == "put"
        group = None
        try:
            versions = None if filtering else fast_versions(msg, self.codec_limits)
            if versions is None:  # the codec decides, and names what is wrong
                group = group_from_proto(msg, self.codec_limits)
                versions = (group.oldest_version, group.newest_version)
            oldest, newest = versions
            if oldest < 0:
                raise CodecError(
                    f"group {msg.group_id!r} has no generated tokens (loss_mask is 0 everywhere)"
                )
        except CodecError as err:
            await self.count_invalid(request)
            raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, f"group: {err.reason}") from None
        await self.check_put_version(request, newest)
        return PutItem(
            group_id=msg.group_id,
            oldest_version=oldest,
            newest_version=newest,
            n_trajectories=len(msg.trajectories),
            payload=payload,
            reservation_id=msg.reservation_id,
            filtered=filtering and group is not None and not self.accepts(group),
        )

    async def check_put_version(self, request: buffer_pb2.PutRequest, newest: int) -> None:
        """Refuse (counted as invalid) tokens from versions beyond current + eta + 1. Checked
        against the highest version seen first, and only on a miss against Redis (one GET):
        the version only grows, so a pass against a lower bound is a pass."""
        eta = self.store.settings.eta
        if put_version_problem(newest, self.version_seen, eta) is None:
            return
        self.note_version(await self.store.get_version())
        why = put_version_problem(newest, self.version_seen, eta)
        if why is not None:
            await self.count_invalid(request)
            raise BoundsRefusal("group.versions", why)

    def put_response(
        self, group_id: str, oldest: int, outcome: PutOutcome
    ) -> buffer_pb2.PutResponse:
        """The answer to an admissible put, with the store's verdict and why."""
        reason = {
            "admitted": "",
            "duplicate": f"group {group_id!r} already put (state {outcome.previous_state}"
            + (f", {outcome.previous_reason}" if outcome.previous_reason else "")
            + "): nothing stored again",
            "stale": f"oldest token version {oldest} < version {outcome.version} - "
            f"max_head_offpolicyness {self.max_head_offpolicyness}",
            "filtered": f"rejected by buffer.filter {self.filter_name!r}",
        }[outcome.result]
        return buffer_pb2.PutResponse(
            result=_RESULTS[outcome.result], reason=reason, version=outcome.version
        )

    def accepts(self, group: Any) -> bool:
        """`buffer.filter`'s verdict; a filter that raises answers INTERNAL, storing nothing."""
        try:
            return bool(self.group_filter(group))  # type: ignore[misc]
        except Exception as err:  # a user filter must not crash the service
            log.exception("buffer.filter raised")
            raise RpcFailure(
                grpc.StatusCode.INTERNAL,
                f"buffer.filter {self.filter_name!r} raised {type(err).__name__}: {err}; "
                "nothing was stored",
            ) from None
