"""The weight-parity probe against a real rollout replica (its own process, torch engine,
the tiny model, float32 on CPU).

A clean update must pass with a difference far below the tolerance; an update whose one
tensor was corrupted on its way to the replica must fail: the difference above the
tolerance, the gauge says so, the replica is unhealthy and paused, and the next clean
update brings it back. The corruption is a wrapper around the gRPC transport that flips the
sign of one parameter and sends a manifest made from the flipped tensors, as a loader bug
upstream of the checksum would: the replica accepts the update, only the probe can tell.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.common.config import FlywheelConfig
from services.common.redis_server import free_port
from services.common.weights.manifest import make_manifest
from services.doctor import checks
from services.doctor.evidence import gather
from services.rollout.client import RolloutClient
from services.trainer.io_loop import IOLoop
from services.trainer.metrics import TrainerMetrics
from services.trainer.model import load_hf_model
from services.trainer.parity import DEFAULT_TOLERANCE, ParityProbe, hf_reference
from services.trainer.weight_sync import WeightPublisher
from tests.trainer.helpers import trainer_config
from tests.trainer.services import running_replica

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CORRUPTED = "model.layers.0.self_attn.o_proj.weight"


@pytest.fixture(scope="module")
def replica(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("parity")
    ports = {"port": free_port(), "metrics_port": free_port()}
    endpoints = [f"services.rollout.{k}={v}" for k, v in ports.items()]
    cfg = trainer_config(tiny_model_dir, root, *endpoints, "trainer.weight_transport=grpc")
    with running_replica(cfg, root) as address:
        io = IOLoop("test-parity")
        try:
            yield {"cfg": cfg, "io": io, "root": root, "address": address}
        finally:
            io.close()


def _updated_weights(cfg: FlywheelConfig, seed: int) -> dict[str, torch.Tensor]:
    """The starting weights moved by a small random step, as a training step would."""
    model = load_hf_model(cfg.actor)
    g = torch.Generator().manual_seed(seed)
    return {
        n: (p.detach() + 0.01 * torch.randn(p.shape, generator=g)).contiguous()
        for n, p in model.named_parameters()
    }


def _corrupting(client: RolloutClient) -> None:
    """Replace `client.stream_weights` by one that flips the sign of `CORRUPTED` in transit
    and sends the manifest of what it sends (the checksum matches: the replica accepts)."""
    send = client.stream_weights

    async def corrupted(named_tensors, manifest, **kw):  # type: ignore[no-untyped-def]
        tensors = dict(named_tensors)
        tensors[CORRUPTED] = -tensors[CORRUPTED]
        return await send(tensors, make_manifest(tensors, manifest.version), **kw)

    client.stream_weights = corrupted  # type: ignore[method-assign]


def test_probe_passes_a_clean_update_and_catches_a_corrupted_tensor(replica: dict) -> None:
    cfg: FlywheelConfig = replica["cfg"]
    addr = replica["address"]
    metrics = TrainerMetrics()
    probe = ParityProbe(
        lambda: hf_reference(cfg),
        log_path=replica["root"] / "weight_parity.jsonl",
        metrics=metrics,
    )
    tol = DEFAULT_TOLERANCE["float32"]
    assert probe.tolerance == tol
    assert metrics.registry.get_sample_value("flywheel_trainer_weight_parity_tolerance") == tol

    def gauge() -> float:
        value = metrics.registry.get_sample_value(
            "flywheel_trainer_weight_parity_max_abs_logprob_diff", {"replica": addr}
        )
        assert value is not None
        return value

    async def run(sd: dict[str, torch.Tensor], version: int, *, corrupt: bool, cfg=cfg):  # type: ignore[no-untyped-def]
        pub = WeightPublisher(cfg, weight_dir=replica["root"] / "w", addresses=[addr], parity=probe)
        try:
            if corrupt:
                _corrupting(pub.clients[addr])
            report = await pub.publish(sd, version)
            applied = list(report.updated)
            report = await pub.check_parity(sd, report)
            stats = await pub.clients[addr].stats()
            return applied, report, set(pub.unhealthy), stats.paused
        finally:
            await pub.close()

    # 1. A clean update: the replica computes what the trainer computes.
    applied, report, unhealthy, paused = replica["io"].run(
        run(_updated_weights(cfg, 1), 1, corrupt=False), timeout=180
    )
    clean = probe.last[addr]
    print(
        f"clean update: max |logp diff| {clean.max_abs_logprob_diff:.3g} over {clean.tokens} tokens"
    )
    assert applied == [addr] and report.updated == [addr] and report.failed == {}
    assert clean.ok and clean.tokens == 3 * 8
    assert clean.max_abs_logprob_diff is not None and clean.max_abs_logprob_diff < tol / 10
    assert gauge() == clean.max_abs_logprob_diff
    assert unhealthy == set() and not paused

    # 2. One tensor's sign flipped in transit: the replica applied it (checksum of what it
    # got), the probe sees the difference, the replica is unhealthy and paused.
    applied, report, unhealthy, paused = replica["io"].run(
        run(_updated_weights(cfg, 2), 2, corrupt=True), timeout=180
    )
    bad = probe.last[addr]
    print(f"corrupted update: max |logp diff| {bad.max_abs_logprob_diff:.3g}")
    assert applied == [addr]  # the transport and the checksum saw nothing wrong
    assert not bad.ok and bad.max_abs_logprob_diff is not None
    assert bad.max_abs_logprob_diff > tol
    assert gauge() == bad.max_abs_logprob_diff > tol
    assert report.updated == [] and report.failed[addr].startswith("parity: ")
    assert unhealthy == {addr} and probe.excluded == {addr} and paused
    # flywheel doctor reads the probe's lines in the run directory: fail while it is off
    assert checks.weight_parity(gather(replica["root"])).status == "fail"

    # 3. The next clean update passes and the replica generates again.
    applied, report, unhealthy, paused = replica["io"].run(
        run(_updated_weights(cfg, 3), 3, corrupt=False), timeout=180
    )
    assert report.updated == [addr] and probe.last[addr].ok
    assert gauge() < tol
    assert unhealthy == set() and probe.excluded == set() and not paused
    lines = (replica["root"] / "weight_parity.jsonl").read_text().splitlines()
    assert [line.count('"ok": true') for line in lines] == [1, 0, 1]
    assert checks.weight_parity(gather(replica["root"])).status == "warn"  # recovered

    # 4. trainer.parity_probe_freq = 2: version 5 is published without a probe (nothing
    # logged, the corrupted tensor goes unseen: the price of the setting), version 6 is probed.
    sparse = cfg.model_copy(deep=True)
    sparse.trainer.parity_probe_freq = 2
    _, report, unhealthy, _ = replica["io"].run(
        run(_updated_weights(cfg, 5), 5, corrupt=True, cfg=sparse), timeout=180
    )
    assert report.updated == [addr] and unhealthy == set()
    assert len((replica["root"] / "weight_parity.jsonl").read_text().splitlines()) == 3
    _, report, _, _ = replica["io"].run(
        run(_updated_weights(cfg, 6), 6, corrupt=False, cfg=sparse), timeout=180
    )
    assert report.updated == [addr] and probe.last[addr].ok
    assert len((replica["root"] / "weight_parity.jsonl").read_text().splitlines()) == 4
