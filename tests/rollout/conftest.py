"""Rollout test fixtures: tiny models (two seeds, for weight updates) and a started engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from services.common.grpc_server import ServiceServer
from services.common.tiny_model import write_tiny_model
from services.rollout.client import RolloutClient
from services.rollout.engine.torch_engine import TorchEngine
from services.rollout.metrics import RolloutMetrics
from services.rollout.servicer import RolloutServicer
from tests.fixtures_models import tiny_model_dir  # noqa: F401 - re-exported fixture

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture as `tiny_model_dir`, other seed: the "new weights" of an update."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny_model_b") / "model", seed=1)


def load_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()


@pytest.fixture
async def engine(tiny_model_dir: Path) -> AsyncIterator[TorchEngine]:  # noqa: F811
    eng = TorchEngine(tiny_model_dir, max_batch_size=4, device="cpu")
    await eng.start()
    try:
        yield eng
    finally:
        await eng.stop()


@pytest.fixture
async def served(
    engine: TorchEngine, tmp_path: Path
) -> AsyncIterator[tuple[TorchEngine, RolloutClient, RolloutMetrics]]:
    """A replica on loopback whose weights root is the test's `tmp_path`."""
    from flywheel_proto.v1 import rollout_pb2_grpc

    metrics = RolloutMetrics()
    server = ServiceServer("rollout", service_names=["flywheel.v1.RolloutService"])
    servicer = RolloutServicer(
        engine,
        rollout_id="rollout-0",
        metrics=metrics,
        set_serving=server.set_serving,
        weights_root=tmp_path,
    )
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, server.server)
    port = await server.start()
    client = RolloutClient(f"127.0.0.1:{port}", timeout=30)
    try:
        yield engine, client, metrics
    finally:
        await client.close()
        await server.stop(grace=1)
