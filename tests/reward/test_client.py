"""Typed async client (`services/reward/client.py`) against a real service on loopback."""

from __future__ import annotations

import pytest

from services.reward.client import RewardClient, RewardClientError, RewardStatus, ScoreItem
from tests.reward.conftest import RunningReward, service_config

pytestmark = pytest.mark.integration


async def test_large_batches_are_split_and_come_back_in_order(
    reward_service: RunningReward,
) -> None:
    # 150 items over max_batch=64: three requests (64 + 64 + 22), one outcome per item.
    items = [ScoreItem(completion=f"#### {k}", answer=f"#### {k % 7}") for k in range(150)]
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
                ScoreItem(completion=b"\xc3\x28", answer="1"),
                ScoreItem(completion="x", fn="sleeps", kwargs={"seconds": 30}, deadline_ms=500),
                ScoreItem(completion="#### 3", answer="3", fn="arithmetic"),
            ]
        )
        single = await client.score(ScoreItem(completion="#### 3", answer="3"), fn="gsm8k")
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
            await client.score_batch([ScoreItem(completion="x")], fn="nope")
        assert err.value.code is not None and err.value.code.name == "INVALID_ARGUMENT"
        with pytest.raises(ValueError, match=r"items\[1\].kwargs is not JSON-serialisable"):
            await client.score_batch(
                [ScoreItem(completion="x"), ScoreItem(completion="x", kwargs={"o": object()})]
            )
        assert await client.score_batch([]) == []


async def test_unreachable_service_is_a_client_error() -> None:
    async with RewardClient("127.0.0.1:1", retries=1, timeout=2.0, max_batch_size=8) as client:
        with pytest.raises(RewardClientError) as err:
            await client.score_batch([ScoreItem(completion="x")])
    assert err.value.code is not None and err.value.code.name in (
        "UNAVAILABLE",
        "DEADLINE_EXCEEDED",
    )


async def test_bearer_token_is_sent_and_required() -> None:
    service = RunningReward(service_config(num_workers=1), auth_token="s3cret")
    try:
        async with RewardClient(service.address, auth_token="s3cret") as client:
            [ok] = await client.score_batch([ScoreItem(completion="#### 2", answer="2")])
        assert ok.ok and ok.reward == 1.0
        async with RewardClient(service.address, retries=0, max_batch_size=8) as anonymous:
            with pytest.raises(RewardClientError) as err:
                await anonymous.score_batch([ScoreItem(completion="#### 2", answer="2")])
        assert err.value.code is not None and err.value.code.name == "UNAUTHENTICATED"
    finally:
        service.stop()
