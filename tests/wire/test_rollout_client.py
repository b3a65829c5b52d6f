"""RolloutClient (`services/wire/rollout_client.py`): how the trainer's calls meet a dead replica."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from services.common.redis_server import free_port
from services.wire.rollout_client import RolloutClient


@pytest.mark.integration
async def test_a_replica_known_down_costs_one_attempt_per_call_until_it_answers() -> None:
    """A publish goes to every replica each step: the first call to a dead one waits its
    short budget out, later calls make one attempt each instead of holding every step."""
    # 3 s: a first connect slowed by a loaded machine could use up 0.3 s alone (one attempt).
    async with RolloutClient(f"127.0.0.1:{free_port()}", outage_budget_s=3.0) as client:
        attempts = 0
        get_version = client._stub.GetVersion  # noqa: SLF001 - count what reaches the wire

        async def counted(request: Any, timeout: float) -> Any:
            nonlocal attempts
            attempts += 1
            return await get_version(request, timeout=timeout)

        client._stub.GetVersion = counted  # noqa: SLF001
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.get_version()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        first = attempts
        assert first >= 2 and client.peer.down  # retried within the budget, then marked down
        with pytest.raises(grpc.aio.AioRpcError):
            await client.get_version()
        assert attempts == first + 1
