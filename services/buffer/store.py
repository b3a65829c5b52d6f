"""Buffer state in Redis: the one place that reads and writes it.

Design, and why not a Redis stream with a consumer group. A stream hands entries out in
insertion order, but the buffer must serve the *oldest version first* and must drop stale
groups at claim time, both of which need ordering by a field of the entry. So the
same semantics are built from sorted sets driven by Lua scripts (see `scripts.py`):

- "pending" plays the stream's undelivered entries, ordered by (oldest version, arrival);
- "inflight" plays the consumer group's pending-entries list (PEL): who holds what since
  when; a claim first moves entries idle longer than `claim_idle_ms` back to pending, which
  is XAUTOCLAIM's job;
- Ack plays XACK + XDEL: the payload is deleted, a tombstone keeps the id so that a
  retried put or ack changes nothing.

Every state change is one script, hence atomic, and every counter lives in Redis next to
the sets it describes, so the invariant `put = acked + dropped + pending + in_flight` is
computed from Redis alone: it survives a buffer restart, and after a Redis crash (AOF,
`appendfsync everysec`) the replayed log holds whole operations only, so the invariant
still holds over what survived; lost puts are simply absent from `put` as well.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError

from services.buffer import resp, scripts

log = logging.getLogger(__name__)

DROP_REASONS = ("stale_at_put", "stale_at_claim", "filtered", "invalid")
"""Every reason a put group can leave the buffer without being trained on."""

_MAX_ETA = 1 << 40  # "unlimited" staleness, small enough to stay exact in Lua doubles


@dataclass(frozen=True)
class StoreSettings:
    """What the store needs from the configuration, in the store's own units."""

    prefix: str
    max_head_offpolicyness: int
    consumer_batch_size: int
    max_concurrent_rollouts: int
    queue_size: int = 1 << 40
    """Most groups put and not yet claimed plus groups being generated (AReaL's output queue
    bound): the rollout runs ahead of the trainer only this far, whatever η allows."""
    max_stored_groups: int = 1024
    max_stored_bytes: int = 1 << 30
    claim_idle_ms: int = 300_000
    reservation_ttl_ms: int = 1_800_000
    tombstone_ttl_s: int = 7 * 24 * 3600
    request_id_ttl_s: int = 3600
    retain_acked_groups: int = 0
    max_reply_bytes: int = 60 << 20
    staleness_check: bool = True

    @property
    def eta(self) -> int:
        return min(self.max_head_offpolicyness, _MAX_ETA) if self.staleness_check else _MAX_ETA


@dataclass(frozen=True)
class PutOutcome:
    """`result` is one of admitted, duplicate, stale, filtered, full; `member` (admitted
    only) is the group's pending-set member, unique to this admission."""

    result: str
    version: int
    previous_state: str = ""
    previous_reason: str = ""
    stored_groups: int = 0
    stored_bytes: int = 0
    member: str = ""


@dataclass(frozen=True)
class PutItem:
    """One group to admit: its id, generated-version range, size and serialized bytes."""

    group_id: str
    oldest_version: int
    newest_version: int
    n_trajectories: int
    payload: bytes | memoryview  # a view of the request's bytes avoids a copy per group
    reservation_id: str = ""
    filtered: bool = False


def _put_outcome(r: Any) -> PutOutcome:
    code, version = _s(r[0]), int(r[1])
    if code == "duplicate":
        return PutOutcome(code, version, _s(r[2]), _s(r[3]))
    if code == "full":
        return PutOutcome(code, version, stored_groups=int(r[2]), stored_bytes=int(r[3]))
    if code == "admitted":
        return PutOutcome(code, version, member=_s(r[2]))
    return PutOutcome(code, version)


@dataclass(frozen=True)
class ClaimedGroup:
    """`payload` is None when the claim asked for none (the caller holds the bytes), and
    may be a view into the request it was put with when it comes from the read cache."""

    group_id: str
    oldest_version: int
    deliveries: int
    member: str
    payload: bytes | memoryview | None


@dataclass(frozen=True)
class ClaimOutcome:
    version: int
    dropped_stale: int
    redelivered: int
    replayed: bool
    groups: list[ClaimedGroup]
    too_big_bytes: int = 0


@dataclass(frozen=True)
class ReserveOutcome:
    reservation_ids: list[str]
    version: int
    capacity: int
    replayed: bool


@dataclass(frozen=True)
class Capacity:
    capacity: int
    version: int
    running: int
    accepted: int


@dataclass(frozen=True)
class GroupSummary:
    group_id: str
    oldest_version: int
    newest_version: int
    n_trajectories: int
    state: str
    reason: str = ""
    has_payload: bool = False


@dataclass
class StatsSnapshot:
    """One atomic read of the accounting; `invariant_ok` is computed from it alone."""

    version: int
    put: int
    admitted: int
    acked: int
    claimed: int
    duplicate: int
    redelivered: int
    dropped: dict[str, int]
    pending: int
    in_flight: int
    stored_bytes: int
    capacity: int
    running: int
    accepted: int
    retained: int
    reservations_expired: int
    extra: dict[str, int] = field(default_factory=dict)

    @property
    def stored_groups(self) -> int:
        return self.pending + self.in_flight

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    @property
    def invariant_ok(self) -> bool:
        """put = acked + sum(dropped) + pending + in_flight, exactly."""
        return self.put == self.acked + self.dropped_total + self.pending + self.in_flight


def _raise_errors(replies: list[Any]) -> list[Any]:
    """Pipeline replies as they are, unless one is an error reply: then that is raised."""
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies


def _s(x: bytes | str | int) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def connect(url: str, password: str | None = None) -> aioredis.Redis:
    """A client that never retries by itself: a state-changing script repeated behind our
    back after a timeout could apply twice, so retries belong to callers that carry ids."""
    kwargs: dict[str, object] = {
        "socket_connect_timeout": 2.0,
        "socket_timeout": 10.0,
        "retry": Retry(NoBackoff(), 0),
        "decode_responses": False,
    }
    if password:
        kwargs["password"] = password
    # redis-py's default pool holds 100 connections and fails the 101st concurrent call with
    # "Too many connections" (a ConnectionError: the buffer would turn NOT_SERVING under
    # load, with Redis healthy). A fleet keeps more calls in flight than that; Redis runs
    # one command at a time, so more connections add nothing: calls past the bound wait for
    # a free connection (for up to the socket timeout) instead of failing.
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=REDIS_CONNECTIONS, timeout=kwargs["socket_timeout"], **kwargs
    )
    return aioredis.Redis.from_pool(pool)  # closing the client closes the pool


REDIS_CONNECTIONS = 64
"""Connections one buffer process opens to Redis at most; further concurrent calls queue."""


class RedisStore:
    """Async access to the buffer state under one key prefix."""

    def __init__(self, client: aioredis.Redis, settings: StoreSettings) -> None:
        self.redis = client
        self.settings = settings
        self.prefix = settings.prefix
        self._scripts = {name: client.register_script(body) for name, body in scripts.ALL.items()}

    async def _run(self, name: str, *args: Any) -> Any:
        return await self._scripts[name](keys=[], args=[self.prefix, *args])

    def _gkey(self, group_id: str) -> str:
        return f"{self.prefix}:g:{group_id}"

    async def ping(self) -> bool:
        return bool(await self.redis.ping())

    async def close(self) -> None:
        await self.redis.aclose()

    # -- put ---------------------------------------------------------------------------
    async def put(
        self,
        *,
        group_id: str,
        oldest_version: int,
        newest_version: int,
        n_trajectories: int,
        payload: bytes,
        reservation_id: str = "",
        filtered: bool = False,
    ) -> PutOutcome:
        item = PutItem(
            group_id,
            oldest_version,
            newest_version,
            n_trajectories,
            payload,
            reservation_id,
            filtered,
        )
        return (await self.put_many([item]))[0]

    async def put_many(self, items: Sequence[PutItem]) -> list[PutOutcome]:
        """Admit each item as its own atomic script, all in one pipelined round trip: the
        per-group rules are unchanged, only the network and event-loop cost is shared."""
        if not items:
            return []
        replies = await self._evalsha_pipelined(
            self._scripts["put"], [(self.prefix, *self._put_args(item)) for item in items]
        )
        return [_put_outcome(r) for r in replies]

    async def _evalsha_pipelined(self, script: Any, arg_lists: list[tuple[Any, ...]]) -> list[Any]:
        """One script run per argument list, in one round trip, through the hand-written
        RESP of `resp.py` (these pipelines carry the megabytes of every put). redis-py's own
        pipelining of scripts asks SCRIPT EXISTS before every execute, a second round trip;
        here a missing script (a restarted or flushed Redis) is handled after the fact
        instead: a command answered NOSCRIPT ran nothing, so exactly those are sent again
        once it is loaded."""
        replies = await self._evalsha_batch(script.sha, arg_lists)
        missing = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
        if missing:
            await self.redis.script_load(script.script)
            again = await self._evalsha_batch(script.sha, [arg_lists[i] for i in missing])
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        return _raise_errors(replies)

    async def _evalsha_batch(self, sha: str, arg_lists: list[tuple[Any, ...]]) -> list[Any]:
        return await resp.run_pipeline(self.redis, [("EVALSHA", sha, 0, *a) for a in arg_lists])

    def _put_args(self, item: PutItem) -> tuple[Any, ...]:
        s = self.settings
        return (
            item.group_id,
            item.oldest_version,
            item.newest_version,
            item.n_trajectories,
            item.payload,
            item.reservation_id,
            s.eta,
            "1" if item.filtered else "0",
            s.max_stored_groups,
            s.max_stored_bytes,
            s.tombstone_ttl_s,
        )

    async def put_invalid(
        self, *, group_id: str = "", request_id: str = "", reservation_id: str = ""
    ) -> tuple[bool, int]:
        """Count a rejected put once; returns (newly counted, version)."""
        s = self.settings
        r = await self._run(
            "put_invalid",
            group_id,
            request_id,
            reservation_id,
            s.tombstone_ttl_s,
            s.request_id_ttl_s,
        )
        return _s(r[0]) == "counted", int(r[1])

    # -- capacity ----------------------------------------------------------------------
    def _capacity_args(self) -> tuple[int, int, int, int]:
        s = self.settings
        return s.max_concurrent_rollouts, s.consumer_batch_size, s.eta, s.queue_size

    async def reserve(
        self,
        *,
        count: int,
        rollout_id: str,
        request_id: str = "",
        served_version: int | None = None,
    ) -> ReserveOutcome:
        """Grant up to `count` reservations. With `served_version` (the version the asking
        replica's weights hold) the staleness term counts from min(buffer version, it), as
        AReaL's capacity counts from the inference engine's version: a replica whose update
        is still in flight starts only what will be fresh enough when claimed."""
        s = self.settings
        r = await self._run(
            "reserve",
            count,
            *self._capacity_args(),
            request_id,
            rollout_id,
            s.reservation_ttl_ms,
            s.request_id_ttl_s,
            "" if served_version is None else served_version,
        )
        return ReserveOutcome(
            reservation_ids=[_s(x) for x in r[3:]],
            version=int(r[0]),
            capacity=int(r[1]),
            replayed=bool(int(r[2])),
        )

    async def release_rollout(self, rollout_id: str) -> int:
        """Release every reservation held by `rollout_id` (a replica restarting after a crash)."""
        if not rollout_id or "#" in rollout_id:
            raise ValueError(f"rollout_id {rollout_id!r} must be non-empty and contain no '#'")
        return int(await self._run("release_rollout", rollout_id))

    async def release(self, reservation_ids: Sequence[str]) -> int:
        if not reservation_ids:
            return 0
        return int(await self._run("release", *reservation_ids))

    async def capacity(self) -> Capacity:
        r = await self._run("capacity", *self._capacity_args())
        return Capacity(
            capacity=int(r[0]), version=int(r[1]), running=int(r[2]), accepted=int(r[3])
        )

    # -- claim / ack -------------------------------------------------------------------
    async def claim(
        self,
        *,
        consumer_id: str,
        n_groups: int,
        allow_partial: bool,
        request_id: str = "",
        with_payloads: bool = True,
    ) -> ClaimOutcome:
        s = self.settings
        r = await self._run(
            "claim",
            consumer_id,
            n_groups,
            s.eta,
            s.claim_idle_ms,
            "1" if allow_partial else "0",
            request_id,
            s.request_id_ttl_s,
            s.tombstone_ttl_s,
            s.retain_acked_groups,
            s.max_reply_bytes,
            "1" if with_payloads else "0",
        )
        groups = [
            ClaimedGroup(
                group_id=_s(r[i]),
                oldest_version=int(r[i + 1]),
                deliveries=int(r[i + 2]),
                member=_s(r[i + 3]),
                payload=bytes(r[i + 4]) if with_payloads else None,
            )
            for i in range(5, len(r), 5)
        ]
        return ClaimOutcome(
            version=int(r[0]),
            dropped_stale=int(r[1]),
            redelivered=int(r[2]),
            replayed=bool(int(r[3])),
            too_big_bytes=int(r[4]),
            groups=groups,
        )

    async def fetch_payloads(self, group_ids: Sequence[str]) -> list[bytes | None]:
        """The stored bytes of each group, in one round trip; None where a group holds none
        any more (retired since it was claimed, e.g. redelivered and acked elsewhere)."""
        if not group_ids:
            return []
        return _raise_errors(
            await resp.run_pipeline(
                self.redis, [("HGET", self._gkey(gid), "d") for gid in group_ids]
            )
        )

    async def ack(self, group_ids: Sequence[str]) -> int:
        if not group_ids:
            return 0
        s = self.settings
        return int(await self._run("ack", s.tombstone_ttl_s, s.retain_acked_groups, *group_ids))

    async def unclaim(self, group_ids: Sequence[str], consumer_id: str) -> int:
        """Return this consumer's claimed groups to pending, as if never handed out."""
        if not group_ids:
            return 0
        return int(await self._run("unclaim", consumer_id, *group_ids))

    async def drop_claimed(self, group_ids: Sequence[str], reason: str) -> int:
        if reason not in DROP_REASONS:
            raise ValueError(f"unknown drop reason {reason!r}; expected one of {DROP_REASONS}")
        if not group_ids:
            return 0
        return int(
            await self._run("drop_claimed", reason, self.settings.tombstone_ttl_s, *group_ids)
        )

    # -- version -----------------------------------------------------------------------
    async def set_version(self, version: int, request_id: str = "") -> tuple[bool, int]:
        """Returns (accepted, current version); a lower version is refused."""
        r = await self._run("set_version", version, request_id, self.settings.request_id_ttl_s)
        return bool(int(r[0])), int(r[1])

    async def get_version(self) -> int:
        raw = await self.redis.get(f"{self.prefix}:version")
        return int(raw) if raw is not None else 0

    # -- stats -------------------------------------------------------------------------
    async def count_lost_puts(self, lost: int) -> int:
        """Add to the count of acknowledged puts Redis lost (`lost_puts` in `P:ctr`, read by
        `stats` as `extra["lost_puts"]`); kept in Redis so that the count survives a
        restart of the buffer. Returns the total."""
        return int(await self.redis.hincrby(f"{self.prefix}:ctr", "lost_puts", lost))

    async def stats(self) -> StatsSnapshot:
        r = await self._run("stats", *self._capacity_args())
        ctr = {_s(r[i]): int(r[i + 1]) for i in range(7, len(r), 2)}
        dropped = {reason: ctr.get(f"dropped:{reason}", 0) for reason in DROP_REASONS}
        for key, value in ctr.items():  # reasons from a newer buffer version stay visible
            if key.startswith("dropped:"):
                dropped.setdefault(key.split(":", 1)[1], value)
        return StatsSnapshot(
            version=int(r[0]),
            pending=int(r[1]),
            in_flight=int(r[2]),
            capacity=int(r[3]),
            running=int(r[4]),
            accepted=int(r[5]),
            retained=int(r[6]),
            put=ctr.get("put", 0),
            admitted=ctr.get("admitted", 0),
            acked=ctr.get("acked", 0),
            claimed=ctr.get("claimed", 0),
            duplicate=ctr.get("duplicate", 0),
            redelivered=ctr.get("redelivered", 0),
            dropped=dropped,
            stored_bytes=ctr.get("stored_bytes", 0),
            reservations_expired=ctr.get("reservations_expired", 0),
            extra=ctr,
        )

    # -- inspection --------------------------------------------------------------------
    async def list_groups(
        self, min_version: int, max_version: int, limit: int = 1000
    ) -> list[GroupSummary]:
        """Admitted groups whose oldest version lies in [min_version, max_version]."""
        idx = f"{self.prefix}:idx"
        gids: list[Any] = await self.redis.zrangebyscore(
            idx, min_version, max_version, start=0, num=limit
        )
        if not gids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for gid in gids:
            pipe.hmget(self._gkey(_s(gid)), "st", "why", "ov", "nv", "n")
            pipe.hexists(self._gkey(_s(gid)), "d")
        rows: list[Any] = await pipe.execute()
        out: list[GroupSummary] = []
        gone: list[bytes] = []
        for gid, fields, has_payload in zip(gids, rows[0::2], rows[1::2], strict=True):
            st, why, ov, nv, n = fields
            if st is None:  # tombstone expired: forget the index entry too
                gone.append(gid)
                continue
            out.append(
                GroupSummary(
                    group_id=_s(gid),
                    oldest_version=int(ov),
                    newest_version=int(nv),
                    n_trajectories=int(n),
                    state=_s(st),
                    reason=_s(why or b""),
                    has_payload=bool(has_payload),
                )
            )
        if gone:
            await self.redis.zrem(idx, *gone)
        return out

    async def read_group(self, group_id: str) -> bytes | None:
        """The stored payload (pending, in flight, or acked and retained), else None."""
        payload: Any = await self.redis.hget(self._gkey(group_id), "d")
        return payload

    async def iter_payloads(
        self, min_version: int, max_version: int, batch: int = 256
    ) -> AsyncIterator[tuple[GroupSummary, bytes]]:
        """Every group in the version range that still has its payload, oldest first."""
        idx = f"{self.prefix}:idx"
        offset = 0
        while True:
            gids: list[Any] = await self.redis.zrangebyscore(
                idx, min_version, max_version, start=offset, num=batch
            )
            if not gids:
                return
            offset += len(gids)
            pipe = self.redis.pipeline(transaction=False)
            for gid in gids:
                pipe.hmget(self._gkey(_s(gid)), "st", "why", "ov", "nv", "n", "d")
            rows: list[Any] = await pipe.execute()
            for gid, (st, why, ov, nv, n, data) in zip(gids, rows, strict=True):
                if st is None or data is None:
                    continue
                summary = GroupSummary(
                    _s(gid), int(ov), int(nv), int(n), _s(st), _s(why or b""), True
                )
                yield summary, bytes(data)

    async def clear(self) -> int:
        """Delete every key under the prefix (replay start-up and tests); returns the count."""
        deleted = 0
        async for key in self.redis.scan_iter(match=f"{_glob_escape(self.prefix)}:*", count=1000):
            deleted += int(await self.redis.unlink(key))
        return deleted


def _glob_escape(text: str) -> str:
    out = []
    for ch in text:
        out.append("\\" + ch if ch in "*?[]\\" else ch)
    return "".join(out)
