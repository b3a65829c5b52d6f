"""The gRPC face of the reward service: validate, deduplicate, cache, score, report.

What fails the RPC and what fails one item is a deliberate split. The request as a whole
is refused (a gRPC status) when the caller asked for something the service will never do:
more items than `max_batch`, an unknown function, a negative or oversized deadline, a
request_id longer than the buffer's `MAX_ID_BYTES` or reused for other content
(INVALID_ARGUMENT); or when it cannot take the work
now (RESOURCE_EXHAUSTED with a `retry-after-ms` trailer; UNAVAILABLE while stopping).
Everything about one completion — invalid UTF-8, too large, bad kwargs JSON (NaN and
Infinity included: JSON has neither; lists and objects nested deeper than
`MAX_KWARGS_DEPTH`), a reference answer the function cannot read, a
function that raised, timed out or blew its limits — is that item's status, with a
message, and its neighbours are scored normally. Nothing becomes a silent 0.0: the caller's
`on_failure` policy decides what a failed item is worth.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from flywheel_proto.v1 import common_pb2, reward_pb2, reward_pb2_grpc
from services.common.config import RewardConfig
from services.common.limits import MAX_ID_BYTES
from services.reward.cache import ScoreCache, cache_key
from services.reward.idempotency import IdempotencyStore, RequestIdConflict
from services.reward.metrics import RewardMetrics
from services.reward.pool import (
    ERROR,
    OK,
    TIMEOUT,
    PoolClosedError,
    PoolFullError,
    ScoreTask,
    TaskResult,
    WorkerPool,
)
from services.reward.registry import RewardRegistry, UnknownFunctionError

log = logging.getLogger(__name__)

INVALID_INPUT = "INVALID_INPUT"
STATUS_TO_PROTO = {
    OK: reward_pb2.REWARD_STATUS_OK,
    TIMEOUT: reward_pb2.REWARD_STATUS_TIMEOUT,
    ERROR: reward_pb2.REWARD_STATUS_ERROR,
    INVALID_INPUT: reward_pb2.REWARD_STATUS_INVALID_INPUT,
}
POSITIONAL = frozenset({"prompt", "completions", "prompt_ids", "completion_ids", "answer"})
RETRY_AFTER_MS = 200
MAX_KWARGS_DEPTH = 64
"""Deepest nesting of lists and objects in an item's `kwargs_json` (a top-level object is
depth 1). Dataset fields are flat or nearly so; the bound keeps every later step (the cache
key, the frame to the worker, the worker's own parse) far from Python's recursion limit."""


class InvalidRequest(ValueError):
    """The request as a whole is malformed; the message names the field."""


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999: valid JSON syntax, but no float holds it
        raise ValueError(f"{text} is out of the range of a float")
    return value


class KwargsTooDeep(ValueError):
    """`kwargs_json` nests lists and objects deeper than `MAX_KWARGS_DEPTH`."""

    def __init__(self) -> None:
        super().__init__(
            f"kwargs_json nests lists and objects deeper than {MAX_KWARGS_DEPTH} levels"
        )


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether `value` nests lists and objects more than `limit` levels (no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            children: Any = v.values()
        elif isinstance(v, list):
            children = v
        else:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children)
    return False


def parse_kwargs_json(text: str) -> Any:
    """`json.loads`, strict: Python's parser accepts NaN, Infinity and -Infinity (and reads
    1e999 as inf), none of which is JSON; a function would receive a value no dataset
    field can hold, so they are refused (ValueError) like any other invalid JSON. Nesting
    deeper than `MAX_KWARGS_DEPTH` is `KwargsTooDeep` (a ValueError), also when it is deep
    enough to exhaust the parser's recursion."""
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise KwargsTooDeep() from None
    if _deeper_than(value, MAX_KWARGS_DEPTH):
        raise KwargsTooDeep()
    return value


def request_id_problem(request_id: str) -> str | None:
    """Why `request_id` cannot be kept for deduplication (None: it can): ids are bounded
    as the buffer bounds them (`MAX_ID_BYTES`), since each is held in the idempotency
    store for up to `reward.idempotency_entries` requests."""
    size = len(request_id.encode("utf-8", "surrogatepass"))
    if size > MAX_ID_BYTES:
        return f"request_id of {size} bytes is longer than {MAX_ID_BYTES} bytes"
    return None


@dataclass
class _Item:
    """One validated item: either ready to score or already answered (invalid input)."""

    fn_name: str
    fn_path: str
    deadline_s: float
    payload: dict[str, Any] | None  # None when `invalid` says why
    invalid: str = ""
    key: bytes | None = None  # cache key, when the cache is on


def _utf8_error(exc: UnicodeDecodeError) -> str:
    return f"completion is not valid UTF-8 ({exc.reason} at byte {exc.start})"


def _result(
    status: str,
    reward: float = 0.0,
    message: str = "",
    *,
    cached: bool = False,
    seconds: float = 0.0,
) -> reward_pb2.ScoreResult:
    return reward_pb2.ScoreResult(
        reward=reward if status == OK else 0.0,
        status=STATUS_TO_PROTO[status],
        message=message,
        cached=cached,
        seconds=seconds,
    )


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    def __init__(
        self,
        config: RewardConfig,
        registry: RewardRegistry,
        pool: WorkerPool,
        metrics: RewardMetrics,
    ) -> None:
        self.config = config
        self.registry = registry
        self.pool = pool
        self.metrics = metrics
        self.cache = ScoreCache(config.cache_size) if config.cache else None
        self._requests: IdempotencyStore[list[reward_pb2.ScoreResult]] = IdempotencyStore(
            config.idempotency_entries
        )

    # --- RPCs ------------------------------------------------------------------------------

    async def Score(
        self, request: reward_pb2.ScoreRequest, context: grpc.aio.ServicerContext
    ) -> reward_pb2.ScoreResult:
        results = await self._handle(context, "Score", request.request_id, request, [request])
        return results[0]

    async def ScoreBatch(
        self, request: reward_pb2.ScoreBatchRequest, context: grpc.aio.ServicerContext
    ) -> reward_pb2.ScoreBatchResponse:
        results = await self._handle(
            context, "ScoreBatch", request.request_id, request, list(request.items)
        )
        return reward_pb2.ScoreBatchResponse(results=results)

    async def ListFunctions(
        self, request: common_pb2.Empty, context: grpc.aio.ServicerContext
    ) -> reward_pb2.ListFunctionsResponse:
        return reward_pb2.ListFunctionsResponse(
            names=self.registry.names(),
            default_fn=self.registry.default.name,
            max_batch_size=self.config.max_batch,
            default_deadline_ms=self.config.deadline_ms,
            max_deadline_ms=self.config.max_deadline_ms,
            max_completion_bytes=self.config.max_completion_bytes,
        )

    # --- the shared path -----------------------------------------------------------------

    async def _handle(
        self,
        context: grpc.aio.ServicerContext,
        rpc: str,
        request_id: str,
        request: Any,
        items: Sequence[reward_pb2.ScoreRequest],
    ) -> list[reward_pb2.ScoreResult]:
        started = time.monotonic()
        try:
            id_problem = request_id_problem(request_id)
            if id_problem is not None:
                raise InvalidRequest(id_problem)
            if len(items) > self.config.max_batch:
                raise InvalidRequest(
                    f"items: {len(items)} items exceed reward.max_batch={self.config.max_batch}; "
                    "split the batch (ListFunctions reports max_batch_size)"
                )
            fingerprint = (
                hashlib.sha256(request.SerializeToString(deterministic=True)).digest()
                if request_id
                else b""
            )
            prepared = self._prepare(items, single=(rpc == "Score"))
            return await self._requests.run(
                request_id,
                fingerprint,
                lambda: self._score(prepared),
                on_duplicate=self.metrics.deduplicated.inc,
            )
        except (InvalidRequest, RequestIdConflict) as exc:
            self.metrics.rejected.labels(reason="invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except PoolFullError as exc:
            self.metrics.rejected.labels(reason="queue_full").inc()
            context.set_trailing_metadata((("retry-after-ms", str(RETRY_AFTER_MS)),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except PoolClosedError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        finally:
            self.metrics.request_seconds.labels(rpc=rpc).observe(time.monotonic() - started)
        raise AssertionError("unreachable: context.abort raises")

    def _prepare(self, items: Sequence[reward_pb2.ScoreRequest], *, single: bool) -> list[_Item]:
        prepared: list[_Item] = []
        for i, item in enumerate(items):
            where = "" if single else f"items[{i}]."
            try:
                fn = self.registry.resolve(item.fn)
            except UnknownFunctionError as exc:
                raise InvalidRequest(f"{where}{exc}") from None
            if item.deadline_ms < 0 or item.deadline_ms > self.config.max_deadline_ms:
                raise InvalidRequest(
                    f"{where}deadline_ms = {item.deadline_ms}: must be in "
                    f"[0, {self.config.max_deadline_ms}] (0 = the default "
                    f"{self.config.deadline_ms} ms)"
                )
            deadline_s = (item.deadline_ms or self.config.deadline_ms) / 1000.0
            entry = _Item(fn.name, fn.path, deadline_s, None)
            prepared.append(entry)
            raw = item.completion
            if len(raw) > self.config.max_completion_bytes:
                entry.invalid = (
                    f"completion of {len(raw)} bytes exceeds reward.max_completion_bytes="
                    f"{self.config.max_completion_bytes}"
                )
                continue
            try:
                completion = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                entry.invalid = _utf8_error(exc)
                continue
            kwargs: dict[str, Any] = {}
            if fn == self.registry.default:
                kwargs.update(self.config.fn_kwargs)
            if item.kwargs_json:
                try:
                    fields = parse_kwargs_json(item.kwargs_json)
                except KwargsTooDeep as exc:
                    entry.invalid = str(exc)
                    continue
                except ValueError as exc:  # JSONDecodeError is one
                    entry.invalid = f"kwargs_json is not valid JSON: {exc}"
                    continue
                if not isinstance(fields, dict):
                    entry.invalid = (
                        f"kwargs_json must be a JSON object, got {type(fields).__name__}"
                    )
                    continue
                clash = sorted(POSITIONAL.intersection(fields))
                if clash:
                    entry.invalid = (
                        f"kwargs_json keys {clash} clash with the function's positional "
                        "parameters; rename those dataset fields"
                    )
                    continue
                kwargs.update(fields)
            entry.payload = {
                "prompt": item.prompt,
                "completion": completion,
                "prompt_ids": list(item.prompt_ids),
                "completion_ids": list(item.completion_ids),
                "answer": item.answer,
                "kwargs": kwargs,
            }
            if self.cache is not None:
                entry.key = cache_key(fn.path, raw, item.answer, kwargs)
        return prepared

    async def _score(self, items: list[_Item]) -> list[reward_pb2.ScoreResult]:
        results: list[reward_pb2.ScoreResult | None] = [None] * len(items)
        tasks: list[ScoreTask] = []
        task_of: list[ScoreTask | None] = [None] * len(items)
        by_key: dict[bytes, ScoreTask] = {}
        for i, item in enumerate(items):
            if item.payload is None:
                results[i] = _result(INVALID_INPUT, message=item.invalid)
                self.metrics.result(item.fn_name, INVALID_INPUT)
                continue
            if item.key is not None and self.cache is not None:
                hit = self.cache.get(item.key)
                if hit is not None:
                    self.metrics.cache_hits.inc()
                    self.metrics.result(item.fn_name, OK)
                    results[i] = _result(OK, hit, cached=True)
                    continue
                self.metrics.cache_misses.inc()
                shared = by_key.get(item.key)
                if shared is not None:  # the same item twice in this batch: score it once
                    task_of[i] = shared
                    continue
            task = ScoreTask(item.fn_name, item.fn_path, item.payload, item.deadline_s)
            tasks.append(task)
            task_of[i] = task
            if item.key is not None:
                by_key[item.key] = task
        if tasks:
            self.pool.submit(tasks)
        done: dict[int, TaskResult] = {}
        try:
            # One wake-up for the whole batch (awaiting each future in turn would wake
            # this coroutine once per item).
            for task, res in zip(
                tasks, await asyncio.gather(*(t.future for t in tasks)), strict=True
            ):
                done[id(task)] = res
        except BaseException:
            # The caller went away (or the pool closed): queued items need not be scored.
            for task in tasks:
                task.future.cancel()
            raise
        for i, shared in enumerate(task_of):
            if shared is None:
                continue
            res = done[id(shared)]
            item = items[i]
            self.metrics.result(item.fn_name, res.status)
            if res.status == OK and item.key is not None and self.cache is not None:
                self.cache.put(item.key, res.reward)
            results[i] = _result(res.status, res.reward, res.message, seconds=res.seconds)
        return [r for r in results if r is not None]
