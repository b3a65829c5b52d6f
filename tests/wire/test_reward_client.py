"""Typed async client (`services/wire/reward_client.py`) against a real service on loopback."""

from __future__ import annotations

import asyncio

import pytest

from services.core.types import RewardStatus, ScoreRequest
from services.wire.reward_client import RewardClient, RewardClientError
from tests.reward.conftest import RunningReward, service_config
from tests.waiting import still_pending, until

pytestmark = pytest.mark.integration


async def test_large_batches_are_split_and_come_back_in_order(
    reward_service: RunningReward,
) -> None:
    # 150 items over max_batch=64: three requests (64 + 64 + 22), one outcome per item.
    items = [ScoreRequest(completion=f"#### {k}", answer=f"#### {k % 7}") for k in range(150)]
    async with RewardClient(reward_service.address) as client:
        assert await client.max_batch_size() == 64
        out = await client.score_batch(items, request_id="split-1")
        again = await client.score_batch(items, request_id="split-1")  # retried: same answers
    assert [o.reward for o in out] == [1.0 if k == k % 7 else 0.0 for k in range(150)]
    assert all(o.status is RewardStatus.OK for o in out)
    assert again == out


async def test_statuses_per_item_and_single_score(reward_service: RunningReward) -> None:
    async with RewardClient(reward_service.address) as client:
        out = await client.score_batch(
            [
                ScoreRequest(completion=b"\xc3\x28", answer="1"),
                ScoreRequest(completion="x", fn="sleeps", kwargs={"seconds": 30}, deadline_ms=500),
                ScoreRequest(completion="#### 3", answer="3", fn="arithmetic"),
            ]
        )
        single = await client.score(ScoreRequest(completion="#### 3", answer="3"), fn="gsm8k")
    assert [o.status for o in out] == [
        RewardStatus.INVALID_INPUT,
        RewardStatus.TIMEOUT,
        RewardStatus.OK,
    ]
    assert not out[0].ok and out[0].reward == 0.0 and "UTF-8" in out[0].message
    assert out[2].ok and out[2].reward == 1.0
    assert single.ok and single.reward == 1.0


async def test_refused_requests_raise_with_the_grpc_code(reward_service: RunningReward) -> None:
    async with RewardClient(reward_service.address, retries=0) as client:
        with pytest.raises(RewardClientError) as err:
            await client.score_batch([ScoreRequest(completion="x")], fn="nope")
        assert err.value.code is not None and err.value.code.name == "INVALID_ARGUMENT"
        with pytest.raises(ValueError, match=r"items\[1\].kwargs is not JSON-serialisable"):
            await client.score_batch(
                [ScoreRequest(completion="x"), ScoreRequest(completion="x", kwargs={"o": object()})]
            )
        assert await client.score_batch([]) == []


async def test_unreachable_service_is_a_client_error() -> None:
    async with RewardClient("127.0.0.1:1", retries=1, timeout=2.0, max_batch_size=8) as client:
        with pytest.raises(RewardClientError) as err:
            await client.score_batch([ScoreRequest(completion="x")])
    assert err.value.code is not None and err.value.code.name in (
        "UNAVAILABLE",
        "DEADLINE_EXCEEDED",
    )


async def test_bearer_token_is_sent_and_required() -> None:
    service = RunningReward(service_config(num_workers=1), auth_token="s3cret")
    try:
        async with RewardClient(service.address, auth_token="s3cret") as client:
            [ok] = await client.score_batch([ScoreRequest(completion="#### 2", answer="2")])
        assert ok.ok and ok.reward == 1.0
        async with RewardClient(service.address, retries=0, max_batch_size=8) as anonymous:
            with pytest.raises(RewardClientError) as err:
                await anonymous.score_batch([ScoreRequest(completion="#### 2", answer="2")])
        assert err.value.code is not None and err.value.code.name == "UNAUTHENTICATED"
        # the refusal is counted on the service's own registry, as the other services do
        refused = service.service.prom.get_sample_value(
            "flywheel_reward_auth_failures_total",
            {"method": "flywheel.v1.RewardService/ScoreBatch", "code": "UNAUTHENTICATED"},
        )
        assert refused == 1.0
    finally:
        service.stop()


@pytest.mark.slow
async def test_a_batch_sent_while_the_service_restarts_is_scored_by_its_successor() -> None:
    """rollout -> reward: the service is down for 5 s (the old client gave up after 3
    retries, under a second); the batch sent meanwhile is scored by a new service on the
    same port, and the outage is exported."""
    from prometheus_client import CollectorRegistry

    from services.common.outage import PeerOutageMetrics
    from services.reward.service import RewardParts, RewardService

    async def serve(port: int) -> RewardService:
        svc = RewardService(
            RewardParts(reward=service_config(num_workers=1), port=port, metrics_port=None)
        )
        await svc.start()
        return svc

    first = await serve(0)
    port = first.port
    registry = CollectorRegistry()
    peer = PeerOutageMetrics("rollout", registry).peer("reward", first.address)
    items = [ScoreRequest(completion=f"#### {k}", answer="#### 2") for k in range(4)]
    async with RewardClient(first.address, peer=peer, max_batch_size=8) as client:
        assert [o.reward for o in await client.score_batch(items)] == [0.0, 0.0, 1.0, 0.0]
        await first.stop(grace=0.5)
        scoring = asyncio.create_task(client.score_batch(items, request_id="during"))
        await until(lambda: peer.down, "the client to see the reward service down")
        await still_pending(scoring, hold_s=5.0)  # waiting for the service, not failed
        second = await serve(port)
        try:
            out = await scoring
        finally:
            await second.stop(grace=0.5)
    assert [o.reward for o in out] == [0.0, 0.0, 1.0, 0.0] and all(o.ok for o in out)
    seconds = registry.get_sample_value(
        "flywheel_rollout_peer_unavailable_seconds_total", {"peer": "reward"}
    )
    assert seconds is not None and seconds > 0
    assert registry.get_sample_value("flywheel_rollout_peer_unavailable", {"peer": "reward"}) == 0
