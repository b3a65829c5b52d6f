"""Disk, torch.distributed (real gloo group, sender in another process) and gRPC chunks
deliver bit-identical weights to the torch engine, with version and checksum."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.common.weights.disk import save_weights
from services.common.weights.manifest import (
    make_manifest,
    named_parameters_for_update,
    tensor_specs,
)
from services.rollout.engine.torch_engine import TorchEngine
from tests.rollout.conftest import load_model

pytestmark = pytest.mark.integration


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_same_weights(engine: TorchEngine, expected: dict[str, torch.Tensor]) -> None:
    got = engine.current_weights()
    assert got.keys() == expected.keys()
    for name, t in expected.items():
        assert torch.equal(got[name], t), name  # bit-identical, not merely close


async def test_disk_transport(served, other_model_dir: Path, tmp_path: Path) -> None:  # noqa: ANN001
    engine, client, metrics = served
    sd = named_parameters_for_update(load_model(other_model_dir))
    manifest = save_weights(tmp_path / "v3", sd, 3)
    r = await client.update_weights_from_disk(str(tmp_path / "v3"), manifest, request_id="u1")
    assert r.ok and r.version == 3 and r.pause_seconds <= r.total_seconds
    assert_same_weights(engine, sd)
    assert (await client.get_version()) == 3
    stats = await client.stats()
    assert stats.checksum == manifest.checksum and stats.weight_updates == 1
    # The same request id again is answered from the record, not applied twice.
    again = await client.update_weights_from_disk(str(tmp_path / "v3"), manifest, request_id="u1")
    assert again == r and engine.stats.weight_updates == 1
    assert metrics.weight_version._value.get() == 3


async def test_grpc_stream_transport(served, other_model_dir: Path) -> None:  # noqa: ANN001
    engine, client, _ = served
    sd = named_parameters_for_update(load_model(other_model_dir))
    manifest = make_manifest(sd, 5)
    # 1000-byte chunks: the 64x64 tensors (16384 B) travel in 17 pieces each.
    r = await client.stream_weights(sd, manifest, chunk_bytes=1000)
    assert r.ok, r.message
    assert r.version == 5
    assert_same_weights(engine, sd)


async def test_grpc_stream_with_a_corrupted_chunk_is_refused(served, other_model_dir: Path) -> None:  # noqa: ANN001
    engine, client, _ = served
    before = {k: v.clone() for k, v in engine.current_weights().items()}
    sd = named_parameters_for_update(load_model(other_model_dir))
    manifest = make_manifest(sd, 1)
    tampered = dict(sd)
    tampered["model.norm.weight"] = sd["model.norm.weight"] + 1  # bytes differ from the manifest
    r = await client.stream_weights(tampered, manifest, chunk_bytes=4096)
    assert not r.ok and "checksum mismatch" in r.message and r.version == 0
    assert_same_weights(engine, before)


async def test_distributed_transport_over_a_real_gloo_group(
    engine: TorchEngine, other_model_dir: Path
) -> None:
    sd = named_parameters_for_update(load_model(other_model_dir))
    port = free_port()
    # Rank 0 (the trainer) in its own process: two updates, 4 KiB buckets then per tensor.
    sender = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.rollout.weights_sender",
            str(other_model_dir),
            str(port),
            "2",
            "4096",
            "0",
        ],
    )
    try:
        await engine.init_weights_group(
            master_address="127.0.0.1",
            master_port=port,
            rank=1,
            world_size=2,
            backend="gloo",
            group_name="flywheel_weights",
        )
        specs = tensor_specs(sd)
        r1 = await engine.update_weights_from_distributed(make_manifest(sd, 1), specs, 4096)
        assert r1.ok, r1.message
        assert_same_weights(engine, sd)
        r2 = await engine.update_weights_from_distributed(make_manifest(sd, 2), specs, 0)
        assert r2.ok and engine.version == 2
        assert_same_weights(engine, sd)
        await engine.close_weights_group()
        assert await asyncio.to_thread(sender.wait, 60) == 0
    finally:
        if sender.poll() is None:
            sender.kill()


async def test_distributed_update_without_a_group_is_refused(
    engine: TorchEngine, other_model_dir: Path
) -> None:
    sd = named_parameters_for_update(load_model(other_model_dir))
    r = await engine.update_weights_from_distributed(make_manifest(sd, 1), tensor_specs(sd), 4096)
    assert not r.ok and "InitWeightsGroup" in r.message and engine.version == 0
