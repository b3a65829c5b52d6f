"""Weights reach a real rollout replica: its next log-probabilities equal the trainer's.

A real rollout replica (`python -m services.rollout --eval-only`, torch engine, the tiny
model) runs as its own process. The trainer (one rank, in this process) takes a training
step, publishes the new weights over each transport, and the replica's log-probabilities
of the tokens it then samples must equal the trainer's own forward pass over the same
tokens under the same temperature. A replica that does not answer is marked unhealthy,
counted, and does not stop the publication.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.common.config import FlywheelConfig
from services.common.redis_server import free_port
from services.rollout.client import RolloutClient
from services.rollout.types import SamplingParams
from services.trainer.io_loop import IOLoop
from services.trainer.logprobs import token_logprobs
from services.trainer.ppo import PPOTrainer
from services.trainer.weight_sync import LATEST_FILE, WeightPublisher, version_dir
from tests.trainer.helpers import synthetic_groups, trainer_config
from tests.trainer.services import ROOT, wait_serving, write_config

pytestmark = pytest.mark.integration

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def setup(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("wsync")
    port = free_port()
    cfg: FlywheelConfig = trainer_config(
        tiny_model_dir,
        root,
        f"services.rollout.port={port}",
        f"services.rollout.metrics_port={free_port()}",
        f"gconfig.temperature={TEMPERATURE}",
        f"actor.temperature={TEMPERATURE}",
        "rollout.weight_update_timeout=60",
    )
    path = write_config(cfg, root / "rollout.yaml")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    log_path = root / "rollout.log"
    log = log_path.open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.rollout", "--config", str(path), "--eval-only"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    io = IOLoop("test-wsync")
    try:
        wait_serving(f"127.0.0.1:{port}", proc, log_path)
        trainer = PPOTrainer(cfg)
        yield {
            "cfg": cfg,
            "trainer": trainer,
            "io": io,
            "root": root,
            "address": f"127.0.0.1:{port}",
        }
    finally:
        io.close()
        # Free the trainer side of the weights group (its TCPStore host) so the replica's
        # leaving barrier fails fast instead of waiting for its timeout.
        gc.collect()
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()


def _sample_and_score(setup: dict, version: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The replica samples a completion; returns (its logprobs, the trainer's, its version)."""
    address = setup["address"]

    async def generate():
        async with RolloutClient(address) as c:
            sampling = SamplingParams(
                n_samples=2, max_new_tokens=12, temperature=TEMPERATURE, seed=7
            )
            return await c.generate(prompt_ids=[[5, 9, 14, 3]], sampling=sampling)

    result = setup["io"].run(generate(), timeout=120)
    trainer: PPOTrainer = setup["trainer"]
    served, recomputed = [], []
    for comp in result.completions:
        ids = torch.tensor([[5, 9, 14, 3, *comp.output_ids]])
        with torch.no_grad():
            logits = trainer.actor.logits(_as_batch(ids))
        lp, _ = token_logprobs(logits, ids, TEMPERATURE)
        served.append(torch.tensor(comp.logprobs, dtype=torch.float32))
        recomputed.append(lp[0, 4:].float())
        assert all(v == version for v in comp.versions)
    return torch.cat(served), torch.cat(recomputed), result.version


def _as_batch(ids: torch.Tensor):
    from services.trainer.batch import SeqBatch

    n = ids.shape[1]
    z = torch.zeros_like(ids, dtype=torch.float32)
    return SeqBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids, dtype=torch.bool),
        loss_mask=z,
        behave_logp=z,
        versions=torch.full_like(ids, -1),
        rewards=torch.zeros(1),
        no_eos=torch.zeros(1, dtype=torch.bool),
        seq_lens=torch.tensor([n]),
        prompt_lens=torch.tensor([n]),
        group_index=torch.zeros(1, dtype=torch.long),
    )


@pytest.mark.parametrize("transport", ["disk", "grpc", "distributed"])
def test_published_weights_give_the_trainers_logprobs(setup: dict, transport: str) -> None:
    cfg: FlywheelConfig = setup["cfg"]
    trainer: PPOTrainer = setup["trainer"]
    io: IOLoop = setup["io"]
    # One step moves the weights away from the replica's initial copy.
    trainer.train_batch(synthetic_groups(Path(cfg.actor.path), n_groups=2))
    sd = trainer.actor.full_state_dict()
    version = trainer.version
    tcfg = cfg.model_copy(
        update={"trainer": cfg.trainer.model_copy(update={"weight_transport": transport})}
    )
    weight_dir = setup["root"] / f"weights-{transport}"

    async def publish():
        pub = WeightPublisher(tcfg, weight_dir=weight_dir, addresses=[setup["address"]])
        try:
            return await pub.publish(sd, version)
        finally:
            await pub.close()

    report = io.run(publish(), timeout=180)
    assert report.failed == {}
    assert report.updated == [setup["address"]]
    if transport == "disk":
        assert (weight_dir / LATEST_FILE).read_text() == version_dir(weight_dir, version).name
    served, recomputed, served_version = _sample_and_score(setup, version)
    assert served_version == version
    # Same weights, same tokens, same temperature: only float reordering between the
    # engine's incremental decoding and the trainer's full-sequence forward.
    torch.testing.assert_close(served, recomputed, rtol=1e-4, atol=1e-4)


def test_unreachable_replica_is_marked_unhealthy_and_counted(setup: dict) -> None:
    cfg: FlywheelConfig = setup["cfg"]
    trainer: PPOTrainer = setup["trainer"]
    sd = trainer.actor.full_state_dict()
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there

    async def publish():
        pub = WeightPublisher(
            cfg, weight_dir=setup["root"] / "w-dead", addresses=[setup["address"], dead]
        )
        try:
            report = await pub.publish(sd, trainer.version)
            return report, pub.failures_total, set(pub.unhealthy)
        finally:
            await pub.close()

    report, failures, unhealthy = setup["io"].run(publish(), timeout=180)
    assert report.updated == [setup["address"]]
    assert list(report.failed) == [dead]
    assert failures == 1
    assert unhealthy == {dead}
