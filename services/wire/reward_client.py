"""Typed async client of the reward service, used by the rollout workflow.

    async with RewardClient("127.0.0.1:50052") as reward:
        outcomes = await reward.score_batch(
            [ScoreRequest(completion=text, answer=row["answer"], prompt=prompt,
                       completion_ids=ids, kwargs={"level": row["level"]}) for text, ids in ...],
            fn="gsm8k",
        )
        for o in outcomes:
            if not o.ok:   # TIMEOUT / ERROR / INVALID_INPUT: apply reward.on_failure
                ...

Batches larger than the service's `max_batch_size` are split (the size is asked once
with ListFunctions) and the parts are sent concurrently; results come back in item order.
Every part carries a request_id derived from the call's, so the retries `call_with_retry`
makes on UNAVAILABLE / DEADLINE_EXCEEDED / RESOURCE_EXHAUSTED never score twice. An outage
of the service (a restart) is ridden through for up to `outage_budget_s` and reported to
the client's `PeerHealth`. An RPC that still fails raises `RewardClientError` (with the gRPC
code): the service stayed unreachable or refused the request; per-item failures are never
raised, they are statuses.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from flywheel_proto.v1 import common_pb2, reward_pb2, reward_pb2_grpc
from services.common.config.services import TLSConfig
from services.common.grpc_client import DEFAULT_OUTAGE_BUDGET_S, RetryingClient, make_channel
from services.common.outage import PeerHealth
from services.core.errors import RewardUnavailableError
from services.core.types import RewardStatus, ScoreRequest, ScoreResult

_FROM_PROTO = {
    reward_pb2.REWARD_STATUS_OK: RewardStatus.OK,
    reward_pb2.REWARD_STATUS_TIMEOUT: RewardStatus.TIMEOUT,
    reward_pb2.REWARD_STATUS_ERROR: RewardStatus.ERROR,
    reward_pb2.REWARD_STATUS_INVALID_INPUT: RewardStatus.INVALID_INPUT,
}


@dataclass(frozen=True)
class FunctionsInfo:
    names: list[str]
    default_fn: str
    max_batch_size: int
    default_deadline_ms: int
    max_deadline_ms: int
    max_completion_bytes: int


class RewardClientError(RewardUnavailableError):
    """The RPC failed as a whole (after retries); `code` is the gRPC status code."""

    def __init__(self, code: grpc.StatusCode | None, details: str) -> None:
        super().__init__(f"reward service: {code.name if code else 'UNKNOWN'}: {details}")
        self.code = code
        self.details = details


class RewardClient(RetryingClient):
    """Async client; one channel, safe to share between coroutines of one event loop.

    `timeout` is the deadline of one attempt; an outage is retried for `outage_budget_s`
    seconds (and at most `retries` times when that is set; 0 turns retries off)."""

    def __init__(
        self,
        address: str,
        *,
        auth_token: str | None = None,
        timeout: float = 300.0,
        retries: int | None = None,
        outage_budget_s: float = DEFAULT_OUTAGE_BUDGET_S,
        max_message_bytes: int = 64 << 20,
        max_batch_size: int | None = None,
        peer: PeerHealth | None = None,
        tls: TLSConfig | None = None,
    ) -> None:
        self._retry_settings("reward", address, timeout, retries, outage_budget_s, peer)
        self._channel = make_channel(
            address, max_message_bytes=max_message_bytes, auth_token=auth_token, tls=tls
        )
        self._stub = reward_pb2_grpc.RewardServiceStub(self._channel)
        self._max_batch_size = max_batch_size
        self._info_lock = asyncio.Lock()

    async def __aenter__(self) -> RewardClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, method: Any, request: Any, timeout: float | None) -> Any:
        try:
            return await self._retrying(method, request, timeout=timeout)
        except grpc.RpcError as err:
            code = err.code() if hasattr(err, "code") else None
            details = err.details() if hasattr(err, "details") else str(err)
            raise RewardClientError(code, details or "") from err

    async def list_functions(self, *, timeout: float | None = None) -> FunctionsInfo:
        resp = await self._call(self._stub.ListFunctions, common_pb2.Empty(), timeout)
        return FunctionsInfo(
            names=list(resp.names),
            default_fn=resp.default_fn,
            max_batch_size=resp.max_batch_size,
            default_deadline_ms=resp.default_deadline_ms,
            max_deadline_ms=resp.max_deadline_ms,
            max_completion_bytes=resp.max_completion_bytes,
        )

    async def max_batch_size(self) -> int:
        """The service's batch limit, asked once (ListFunctions) and remembered."""
        if self._max_batch_size is None:
            async with self._info_lock:
                if self._max_batch_size is None:
                    info = await self.list_functions()
                    self._max_batch_size = max(1, info.max_batch_size)
        return self._max_batch_size

    async def score_batch(
        self,
        items: Sequence[ScoreRequest],
        *,
        fn: str = "",
        deadline_s: float | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> list[ScoreResult]:
        """Score `items`; one outcome per item, in order. Raises `RewardClientError` only
        when an RPC fails as a whole, `ValueError` for an item that cannot be encoded."""
        if not items:
            return []
        deadline_ms = int(round(deadline_s * 1000)) if deadline_s is not None else 0
        requests = [_to_proto(i, item, fn, deadline_ms) for i, item in enumerate(items)]
        size = await self.max_batch_size()
        rid = request_id or uuid.uuid4().hex
        parts = [requests[k : k + size] for k in range(0, len(requests), size)]

        async def send(k: int, part: list[reward_pb2.ScoreRequest]) -> list[ScoreResult]:
            part_id = rid if len(parts) == 1 else f"{rid}/{k}"
            resp = await self._call(
                self._stub.ScoreBatch,
                reward_pb2.ScoreBatchRequest(request_id=part_id, items=part),
                timeout,
            )
            if len(resp.results) != len(part):
                raise RewardClientError(
                    grpc.StatusCode.INTERNAL,
                    f"{len(resp.results)} results for {len(part)} items",
                )
            return [_from_proto(r) for r in resp.results]

        outcomes = await asyncio.gather(*(send(k, p) for k, p in enumerate(parts)))
        return [o for part in outcomes for o in part]

    async def score(
        self,
        item: ScoreRequest,
        *,
        fn: str = "",
        deadline_s: float | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> ScoreResult:
        """Score one item (the `Score` RPC)."""
        deadline_ms = int(round(deadline_s * 1000)) if deadline_s is not None else 0
        req = _to_proto(0, item, fn, deadline_ms)
        req.request_id = request_id or uuid.uuid4().hex
        return _from_proto(await self._call(self._stub.Score, req, timeout))


def _to_proto(index: int, item: ScoreRequest, fn: str, deadline_ms: int) -> reward_pb2.ScoreRequest:
    completion = item.completion
    if isinstance(completion, str):
        # surrogatepass: a lone surrogate from a tokenizer reaches the service, which then
        # answers INVALID_INPUT for that item instead of the client raising for the batch.
        completion = completion.encode("utf-8", "surrogatepass")
    try:
        kwargs_json = json.dumps(dict(item.kwargs), allow_nan=False) if item.kwargs else ""
    except (TypeError, ValueError) as exc:
        raise ValueError(f"items[{index}].kwargs is not JSON-serialisable: {exc}") from None
    return reward_pb2.ScoreRequest(
        fn=item.fn or fn,
        prompt=item.prompt,
        completion=completion,
        prompt_ids=list(item.prompt_ids),
        completion_ids=list(item.completion_ids),
        answer=item.answer,
        kwargs_json=kwargs_json,
        deadline_ms=item.deadline_ms or deadline_ms,
    )


def _from_proto(r: reward_pb2.ScoreResult) -> ScoreResult:
    status = _FROM_PROTO.get(r.status, RewardStatus.ERROR)
    return ScoreResult(
        reward=float(r.reward),
        ok=status is RewardStatus.OK,
        status=status,
        message=r.message if r.status in _FROM_PROTO else f"unknown status {r.status}: {r.message}",
        cached=r.cached,
        seconds=float(r.seconds),
    )
