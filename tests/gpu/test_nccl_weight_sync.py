"""GPU end to end: the trainer on CUDA publishes to a rollout replica whose torch engine runs
on CUDA, over NCCL, and the replica then samples with exactly the trainer's weights.

Skipped without CUDA (this file is kept runnable for whenever a GPU machine is available:
`pytest tests/gpu -m gpu`). NCCL refuses two ranks on one device, so the NCCL case needs
two CUDA devices (trainer on device 0, the replica process on device 1); with one device,
the same check runs over the disk and gRPC transports (CUDA trainer and CUDA engine, no
NCCL). Tolerance: float32 with TF32 off; the replica decodes incrementally and the trainer
runs the full sequence, so only reduction order differs (atol 1e-4, as on CPU).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.common.config import FlywheelConfig
from services.common.redis_server import free_port
from services.core.types import SamplingParams
from services.rollout.client import RolloutClient
from services.trainer.io_loop import IOLoop
from services.trainer.logprobs import token_logprobs
from services.trainer.ppo import PPOTrainer
from services.trainer.weight_sync import WeightPublisher
from tests.trainer.helpers import synthetic_groups, trainer_config
from tests.trainer.services import ROOT, wait_serving, write_config
from tests.trainer.test_weight_sync import _as_batch

CUDA = torch.cuda.is_available()
DEVICES = torch.cuda.device_count() if CUDA else 0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(not CUDA, reason="needs CUDA (torch.cuda.is_available() is False)"),
]

TEMPERATURE = 0.7
PROMPT = [5, 9, 14, 3]


@pytest.fixture(scope="module")
def gpu_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    torch.backends.cuda.matmul.allow_tf32 = False
    root = tmp_path_factory.mktemp("gpu-wsync")
    port = free_port()
    cfg: FlywheelConfig = trainer_config(
        tiny_model_dir,
        root,
        "trainer.device=cuda",
        "trainer.backend=nccl",
        "rollout.torch_device=cuda",
        f"services.rollout.port={port}",
        f"services.rollout.metrics_port={free_port()}",
        f"gconfig.temperature={TEMPERATURE}",
        f"actor.temperature={TEMPERATURE}",
        "rollout.weight_update_timeout=120",
        f"trainer.weight_dir={root}",  # the replica's weights root: publications go under it
    )
    path = write_config(cfg, root / "rollout.yaml")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    if DEVICES >= 2:  # NCCL: one device per rank
        env["CUDA_VISIBLE_DEVICES"] = "1"
    log_path = root / "rollout.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.rollout", "--config", str(path), "--eval-only"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    io = IOLoop("test-gpu-wsync")
    try:
        wait_serving(f"127.0.0.1:{port}", proc, log_path, timeout=300)
        yield {"cfg": cfg, "trainer": PPOTrainer(cfg), "io": io, "root": root, "port": port}
    finally:
        io.close()
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _transports() -> list[str]:
    return ["disk", "grpc", "distributed"] if DEVICES >= 2 else ["disk", "grpc"]


@pytest.mark.parametrize("transport", _transports())
def test_cuda_trainer_to_cuda_engine(gpu_run: dict, transport: str) -> None:
    cfg: FlywheelConfig = gpu_run["cfg"]
    trainer: PPOTrainer = gpu_run["trainer"]
    io: IOLoop = gpu_run["io"]
    address = f"127.0.0.1:{gpu_run['port']}"
    trainer.train_batch(synthetic_groups(Path(cfg.actor.path), n_groups=2))
    sd = trainer.actor.full_state_dict()
    assert next(iter(trainer.actor.module.parameters())).is_cuda

    async def served_version() -> int:
        async with RolloutClient(address) as c:
            return await c.get_version()

    version = io.run(served_version(), timeout=30) + 1
    tcfg = cfg.model_copy(
        update={"trainer": cfg.trainer.model_copy(update={"weight_transport": transport})}
    )

    async def publish():  # noqa: ANN202
        pub = WeightPublisher(
            tcfg, weight_dir=gpu_run["root"] / f"w-{transport}", addresses=[address]
        )
        try:
            return await pub.publish(sd, version)
        finally:
            await pub.close()

    report = io.run(publish(), timeout=300)
    assert report.failed == {} and report.updated == [address]

    async def generate():  # noqa: ANN202
        async with RolloutClient(address) as c:
            s = SamplingParams(n_samples=2, max_new_tokens=12, temperature=TEMPERATURE, seed=7)
            return await c.generate(prompt_ids=[PROMPT], sampling=s)

    result = io.run(generate(), timeout=120)
    assert result.version == version
    for comp in result.completions:
        assert comp.versions == [version] * len(comp.output_ids)
        ids = torch.tensor([[*PROMPT, *comp.output_ids]])
        with torch.no_grad():
            logits = trainer.actor.logits(_as_batch(ids))
        lp, _ = token_logprobs(logits, ids.to(logits.device), TEMPERATURE)
        torch.testing.assert_close(
            torch.tensor(comp.logprobs, dtype=torch.float32),
            lp[0, len(PROMPT) :].float().cpu(),
            rtol=1e-4,
            atol=1e-4,
        )
