"""`evaluate`: held-out accuracy through a real rollout server (the tiny model on the torch
engine, gRPC on loopback) and a real reward service, and the range of versions it reports.

During a run the launcher evaluates while the trainer trains on, so the replica can take
new weights between and within the evaluation's batches; `version_min` and `version` name
the range the accuracy mixes (the newest is what `evals.jsonl` has always kept).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from services.launcher.evaluation import evaluate
from services.rollout.engine.torch_engine import TorchEngine
from tests.fixtures_models import tiny_model_dir  # noqa: F401 - fixture
from tests.reward.conftest import RunningReward, service_config
from tests.rollout.conftest import engine, served  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (5, 6)] * 2]
BATCH = 2  # three Generate calls of two prompts


@pytest.fixture(scope="module")
def reward_address() -> Iterator[str]:
    svc = RunningReward(service_config(num_workers=1))
    try:
        yield svc.address
    finally:
        svc.stop()


async def _evaluate(rollout_address: str, reward_address: str) -> Any:
    # evaluate() blocks on gRPC; the rollout server runs on this test's event loop.
    return await asyncio.to_thread(
        evaluate,
        rollout_address,
        reward_address,
        ROWS,
        reward_fn="gsm8k",
        max_new_tokens=3,
        batch=BATCH,
    )


async def test_a_replica_that_keeps_its_weights_gives_one_version(
    served,  # noqa: ANN001, F811
    reward_address,  # noqa: ANN001
) -> None:
    replica, client, _ = served
    replica.version = 4  # as after four published steps
    result = await _evaluate(client.address, reward_address)
    assert (result.n, result.failures) == (len(ROWS), 0)
    assert result.version_min == result.version == 4
    assert 0.0 <= result.accuracy <= 1.0 and result.mean_reward >= 0.0


async def test_weights_changing_during_the_evaluation_widen_the_range(
    served,  # noqa: ANN001, F811
    reward_address,  # noqa: ANN001
) -> None:
    replica, client, _ = served

    def publish_each_step(e: TorchEngine) -> None:  # a trainer publishing as fast as it can
        e.version += 1

    replica.on_step = publish_each_step
    try:
        result = await _evaluate(client.address, reward_address)
    finally:
        replica.on_step = None
    assert result.n == len(ROWS)
    # The first token came from the initial weights (the hook runs after a step). Each
    # answer carries the version the replica served when it was built; the hook of a call's
    # last step may run just after that, so the newest seen is the final version or one
    # less, and at least one version per call but the last has passed.
    assert result.version_min == 0
    assert replica.version - 1 <= result.version <= replica.version
    assert result.version >= len(ROWS) // BATCH - 1
