"""Resume equivalence with a real buffer on a real Redis and the trainer as its own process:
4 steps straight == 2 steps, SIGKILL, resume, 2 steps (same losses, same group ids)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import torch

from services.common.config import FlywheelConfig
from services.common.redis_server import RedisServer, free_port
from services.trainer.client import TrainerClient
from tests.trainer.helpers import synthetic_groups, trainer_config
from tests.trainer.services import running_buffer, start_trainer, write_config

pytestmark = pytest.mark.integration


def _config(model: Path, root: Path, name: str) -> FlywheelConfig:
    return trainer_config(
        model,
        root,
        f"experiment_name={name}",
        "total_train_steps=4",
        "trainer.save_freq_steps=2",
        "rollout.consumer_batch_size=2",
        "rollout.max_head_offpolicyness=10",
        "actor.ppo_n_minibatches=2",
        "actor.optimizer.lr_scheduler_type=cosine",
        "actor.optimizer.warmup_steps=1",
        "trainer.claim_wait_ms=200",
        f"services.trainer.port={free_port()}",
    )


def _with_buffer_port(cfg: FlywheelConfig, port: int) -> FlywheelConfig:
    services = cfg.services.model_copy(
        update={"buffer": cfg.services.buffer.model_copy(update={"port": port})}
    )
    return cfg.model_copy(update={"services": services})


def _steps(cfg: FlywheelConfig) -> list[dict]:
    path = Path(cfg.cluster.fileroot) / cfg.experiment_name / cfg.trial_name / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_kill_and_resume_continues_exactly(
    tiny_model_dir: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    batches = [
        synthetic_groups(tiny_model_dir, n_groups=2, seed=s, prefix=f"b{s}-") for s in range(4)
    ]

    # Straight: 4 steps on 4 batches.
    straight = _config(tiny_model_dir, tmp_path, "straight")
    with running_buffer(straight, redis_server.url) as buf:
        straight = _with_buffer_port(straight, buf.port)
        for b in batches:
            assert buf.put(b) == ["admitted", "admitted"]
        path = write_config(straight, tmp_path / "straight.yaml")
        proc = start_trainer(path, log_path=tmp_path / "straight.log")
        assert proc.wait(timeout=300) == 0, (tmp_path / "straight.log").read_text()[-3000:]
        # The finished run is recorded as such, and a trainer started on it trains nothing.
        run_dir = tmp_path / "straight" / "t"
        done = json.loads((run_dir / "checkpoints" / "completed.json").read_text())
        assert (done["state"], done["step"], done["version"]) == ("completed", 4, 4)
        assert json.loads((run_dir / "trainer_exit.json").read_text())["code"] == 0
        again = start_trainer(path, log_path=tmp_path / "again.log")
        assert again.wait(timeout=120) == 0
        assert "run already completed at step 4" in (tmp_path / "again.log").read_text()
        assert len(_steps(straight)) == 4

    # Interrupted: 2 batches, 2 steps (checkpoint at step 2), SIGKILL while it waits for
    # data, 2 more batches, a new process resumes and finishes.
    resumed = _config(tiny_model_dir, tmp_path, "resumed")
    with running_buffer(resumed, redis_server.url) as buf:
        resumed = _with_buffer_port(resumed, buf.port)
        for b in batches[:2]:
            buf.put(b)
        path = write_config(resumed, tmp_path / "resumed.yaml")
        log = tmp_path / "resumed.log"
        first = start_trainer(path, log_path=log)
        address = f"127.0.0.1:{resumed.services.trainer.port}"

        async def status():
            async with TrainerClient(address, timeout=2.0, retries=0) as c:
                return await c.status()

        deadline = time.monotonic() + 300  # guards a hang; not a timing assertion
        while True:
            assert first.poll() is None, log.read_text()[-3000:]
            try:
                st = buf.call(status())
                if st.step == 2 and st.last_checkpoint_step == 2 and st.phase == "waiting_for_data":
                    break
            except Exception:  # noqa: BLE001 - not serving yet
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        for b in batches[2:]:
            buf.put(b)
        second = start_trainer(path, log_path=log)
        assert second.wait(timeout=300) == 0, log.read_text()[-3000:]
        stats = buf.call(buf.client.stats())
        assert stats.invariant_ok
        assert stats.acked_total == 8 and stats.in_flight == 0 and stats.pending == 0

    a, b = _steps(straight), _steps(resumed)
    assert [r["step"] for r in a] == [1, 2, 3, 4]
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [r["group_ids"] for r in a] == [r["group_ids"] for r in b]
    assert [r["version"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b, strict=True):
        # Same weights, optimizer moments, schedule and data: bit-identical arithmetic.
        torch.testing.assert_close(ra["losses"], rb["losses"], rtol=0, atol=1e-7)
        assert ra["lr"] == rb["lr"]
    assert "resumed" in log.read_text()
