"""Resume equivalence with a real buffer on a real Redis and the trainer as its own process:
4 steps straight == 2 steps, SIGKILL, resume, 2 steps (same losses, same group ids);
and, at the end, the rules of services/trainer/resume.py on their own."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.config import FlywheelConfig
from services.common.redis_server import RedisServer, free_port
from services.trainer.client import TrainerClient
from services.trainer.resume import CLAIM_FILE, claim_in_flight, record_claim, resume_version
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


def _wait_idle_at(
    buf: Any,
    proc: subprocess.Popen,
    log: Path,
    cfg: FlywheelConfig,
    *,
    step: int,
    checkpoint_step: int,
) -> None:
    """Until the trainer at `cfg`'s port reports `step`, its last checkpoint at
    `checkpoint_step`, and waits for data (nothing in flight between its steps)."""
    address = f"127.0.0.1:{cfg.services.trainer.port}"

    async def status():
        async with TrainerClient(address, timeout=2.0, retries=0) as c:
            return await c.status()

    deadline = time.monotonic() + 300  # guards a hang; not a timing assertion
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            st = buf.call(status())
            if (st.step, st.last_checkpoint_step, st.phase) == (
                step,
                checkpoint_step,
                "waiting_for_data",
            ):
                return
        except Exception:  # noqa: BLE001 - not serving yet
            pass
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)


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
        _wait_idle_at(buf, first, log, resumed, step=2, checkpoint_step=2)
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


def test_groups_acked_after_the_checkpoint_are_counted_on_resume(
    tiny_model_dir: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    """Step 3 is trained and acknowledged after the checkpoint of step 2, then the
    trainer is killed. Its 2 groups stay acknowledged in the buffer (never served again),
    and the resumed trainer counts them: checkpoint's 4 + lost 2 = the buffer's 6 at resume,
    and at the end 4 steps x 2 groups + 2 lost = the buffer's 10."""
    batches = [
        synthetic_groups(tiny_model_dir, n_groups=2, seed=s, prefix=f"l{s}-") for s in range(5)
    ]
    cfg = _config(tiny_model_dir, tmp_path, "ledger")
    run_dir = tmp_path / "ledger" / "t"
    with running_buffer(cfg, redis_server.url) as buf:
        cfg = _with_buffer_port(cfg, buf.port)
        for b in batches[:3]:
            buf.put(b)
        path = write_config(cfg, tmp_path / "ledger.yaml")
        log = tmp_path / "ledger.log"
        first = start_trainer(path, log_path=log)
        _wait_idle_at(buf, first, log, cfg, step=3, checkpoint_step=2)
        before = json.loads((run_dir / "ledger.json").read_text())
        assert (before["trainer_acked"], before["acked_lost_with_crash"]) == (6, 0)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        for b in batches[3:]:
            buf.put(b)
        second = start_trainer(path, log_path=log)
        assert second.wait(timeout=300) == 0, log.read_text()[-3000:]
        stats = buf.call(buf.client.stats())

    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["buffer_acked_at_resume"] == 6 and ledger["resumed_from"] == "step_00000002"
    assert ledger["lost_this_crash"] == 2
    assert (ledger["trainer_acked"], ledger["acked_lost_with_crash"], ledger["resumes"]) == (
        8,
        2,
        1,
    )
    assert stats.acked_total == 10 == ledger["trainer_acked"] + ledger["acked_lost_with_crash"]
    lost = [json.loads(x) for x in (run_dir / "metrics.lost.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lost] == [3]
    assert len(lost[0]["group_ids"]) == ledger["acked_lost_with_crash"]
    trained = [g for r in _steps(cfg) for g in r["group_ids"]]
    assert not set(trained) & set(lost[0]["group_ids"])  # never trained twice
    assert "ledger reconciled with the buffer after a crash" in log.read_text()


# ------------------------------------------------------------ the rules of resume.py itself


def test_the_claim_in_flight_is_kept_whole_and_the_last_one_wins(tmp_path: Path) -> None:
    assert claim_in_flight(tmp_path) is None  # no trainer of this run has claimed yet
    record_claim(tmp_path, "trainer-x:aaa", 3)
    record_claim(tmp_path, "trainer-x:bbb", 4)
    assert claim_in_flight(tmp_path) == "trainer-x:bbb"
    assert json.loads((tmp_path / CLAIM_FILE).read_text()) == {
        "request_id": "trainer-x:bbb",
        "step": 4,
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == [CLAIM_FILE]  # no temp file left


@pytest.mark.parametrize(
    ("checkpoint", "buffer", "replicas", "expected"),
    [
        (5, 5, {"r0": 5, "r1": 5}, 5),  # nothing ran past the checkpoint
        (5, 0, {}, 5),  # a fresh buffer (its version is set from the checkpoint)
        (5, 9, {"r0": 9}, 10),  # trained and published to 9 after it: 9 + 1
        (5, 7, {"r0": 7, "r1": 8}, 9),  # a replica saw 8 before the buffer did: 8 + 1
        (5, 5, {"r0": None, "r1": 6}, 7),  # an unreachable replica says nothing
        (5, 3, {"r0": 4}, 5),  # behind the checkpoint: the checkpoint's version
    ],
)
def test_restored_weights_never_reuse_a_version_tag(
    checkpoint: int, buffer: int, replicas: dict[str, int | None], expected: int
) -> None:
    v = resume_version(checkpoint, buffer, replicas)
    assert v == expected
    seen = [buffer, *(x for x in replicas.values() if x is not None)]
    # Every token generated so far has v_behave <= max(seen): with v > every version
    # seen past the checkpoint, v - v_behave >= 1 for all of them, and no tag names two
    # sets of weights.
    assert v >= checkpoint
    assert v == checkpoint or v > max(seen)
