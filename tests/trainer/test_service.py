"""The trainer service as a user runs it: gRPC control, /metrics, metrics.jsonl, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from services.common.redis_server import RedisServer, free_port
from services.trainer.client import TrainerClient
from tests.trainer.helpers import synthetic_groups, trainer_config
from tests.trainer.services import ROOT, running_buffer, start_trainer, wait_serving, write_config

pytestmark = pytest.mark.integration


def _wait(fn, proc, log: Path, what: str, timeout: float = 300):
    deadline = time.monotonic() + timeout  # guards a hang; not a timing assertion
    while True:
        assert proc.poll() is None, (
            f"trainer exited while waiting for {what}:\n" + log.read_text()[-3000:]
        )
        try:
            value = fn()
            if value:
                return value
        except Exception:  # noqa: BLE001 - not there yet
            pass
        assert time.monotonic() < deadline, f"no {what}:\n" + log.read_text()[-3000:]
        time.sleep(0.1)


def test_control_metrics_and_clean_exit(
    tiny_model_dir: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    port, mport = free_port(), free_port()
    cfg = trainer_config(
        tiny_model_dir,
        tmp_path,
        "total_train_steps=10",
        "trainer.save_freq_steps=100",
        "rollout.consumer_batch_size=2",
        "rollout.max_head_offpolicyness=10",
        "actor.ppo_n_minibatches=1",
        "actor.recompute_logprob=true",
        "actor.use_decoupled_loss=true",
        "actor.prox_logp_method=recompute",
        "trainer.claim_wait_ms=100",
        f"services.trainer.port={port}",
        f"services.trainer.metrics_port={mport}",
    )
    with running_buffer(cfg, redis_server.url) as buf:
        services = cfg.services.model_copy(
            update={"buffer": cfg.services.buffer.model_copy(update={"port": buf.port})}
        )
        cfg = cfg.model_copy(update={"services": services})
        buf.put(synthetic_groups(tiny_model_dir, n_groups=2, seed=0))
        log = tmp_path / "trainer.log"
        proc = start_trainer(write_config(cfg, tmp_path / "cfg.yaml"), log_path=log)
        address = f"127.0.0.1:{port}"
        wait_serving(address, proc, log)

        def call(method: str, *args):
            async def run():
                async with TrainerClient(address, timeout=10.0) as c:
                    return await getattr(c, method)(*args)

            return buf.call(run())

        _wait(lambda: call("status").step == 1, proc, log, "step 1")
        st = call("status")
        assert st.version == 1 and st.world_size == 1 and st.total_train_steps == 10
        # ppo_n_minibatches=1 with recompute: importance weight exactly 1, wherever exported.
        assert st.last_stats["importance_weight/avg"] == 1.0
        text = _wait(
            lambda: httpx.get(f"http://127.0.0.1:{mport}/metrics", timeout=60).text,
            proc,
            log,
            "/metrics",
        )
        assert "flywheel_trainer_importance_weight 1.0" in text
        assert "flywheel_trainer_steps_total 1.0" in text
        assert "flywheel_trainer_version 1.0" in text
        assert 'flywheel_trainer_phase_seconds_count{phase="train"} 1.0' in text
        assert httpx.get(f"http://127.0.0.1:{mport}/readyz", timeout=60).status_code == 200

        assert call("pause").paused
        _wait(lambda: call("status").phase == "paused", proc, log, "paused phase")
        buf.put(synthetic_groups(tiny_model_dir, n_groups=2, seed=1))
        saved = call("save_checkpoint", "save-1")
        assert saved.step == 1 and saved.version == 1
        assert (Path(saved.path) / "trainer_state.json").is_file()
        again = call("save_checkpoint", "save-1")  # a retry: same checkpoint, not a new one
        assert again == saved
        assert call("status").step == 1  # paused: the second batch waits
        call("resume")
        _wait(lambda: call("status").step == 2, proc, log, "step 2 after resume")
        call("stop")
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]

    run_dir = tmp_path / "t" / "t"
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    assert all(r["importance_weight"] == 1.0 for r in lines)
    needed = {
        "step",
        "version",
        "task_reward",
        "staleness_max",
        "staleness_avg",
        "importance_weight",
        "behave_imp_weight",
        "no_eos_ratio",
        "loss",
        "grad_norm",
        "lr",
        "samples",
        "step_seconds",
        "wall_time",
        "group_ids",
    }
    assert needed <= set(lines[0])
    assert lines[0]["samples"] == 8  # 2 groups x 4 trajectories
    # Stop saved the last step (save_on_exit).
    assert (run_dir / "checkpoints" / "step_00000002" / "trainer_state.json").is_file()
    # The exit textfile holds the final series (for a scraper that came too late).
    final = (run_dir / "trainer_metrics.prom").read_text()
    assert "flywheel_trainer_steps_total 2.0" in final
    assert "flywheel_trainer_version 2.0" in final


def test_bad_config_exits_2_naming_the_field(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "services.trainer", "actor.ppo_n_minibatches=0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "ppo_n_minibatches" in proc.stderr


def _health(address: str, service: str) -> str:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2.0
            )
        except grpc.RpcError as err:
            return err.code().name  # NOT_FOUND: the name is not registered at all
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def test_every_node_answers_the_probe_and_only_rank_0_exports_statistics(
    tiny_model_dir: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    """Two trainer "nodes" of one rank each (global ranks 0 and 1, both local rank 0, as
    two pods of the chart's trainer with nprocPerNode=1) over a real gloo group: each
    answers grpc.health for `flywheel.v1.TrainerService` (the chart's probe), and only
    rank 0's /metrics has the RL gauges, which appear with the first step."""
    import os

    cfg = trainer_config(
        tiny_model_dir,
        tmp_path,
        "total_train_steps=1",
        "trainer.save_freq_steps=null",
        "rollout.consumer_batch_size=2",
        "rollout.max_head_offpolicyness=10",
        "trainer.claim_wait_ms=100",
    )
    ports = [(free_port(), free_port()) for _ in range(2)]
    master = free_port()
    with running_buffer(cfg, redis_server.url) as buf:
        services = cfg.services.model_copy(
            update={"buffer": cfg.services.buffer.model_copy(update={"port": buf.port})}
        )
        path = write_config(cfg.model_copy(update={"services": services}), tmp_path / "c.yaml")
        procs, logs = [], []
        for rank, (port, mport) in enumerate(ports):
            env = dict(
                os.environ,
                RANK=str(rank),
                LOCAL_RANK="0",
                WORLD_SIZE="2",
                LOCAL_WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(master),
                OMP_NUM_THREADS="1",
                PYTHONUNBUFFERED="1",
            )
            log = tmp_path / f"rank{rank}.log"
            args = [f"services.trainer.port={port}", f"services.trainer.metrics_port={mport}"]
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "services.trainer", "--config", str(path), *args],
                    cwd=ROOT,
                    env=env,
                    stdout=log.open("wb"),
                    stderr=subprocess.STDOUT,
                )
            )
            logs.append(log)
        try:
            for rank, (port, _) in enumerate(ports):
                name = "flywheel.v1.TrainerService"
                _wait(
                    lambda p=port, n=name: _health(f"127.0.0.1:{p}", n) == "SERVING",
                    procs[rank],
                    logs[rank],
                    f"rank {rank} SERVING {name}",
                )
            metrics = [f"http://127.0.0.1:{m}/metrics" for _, m in ports]
            # No batch yet: no statistic anywhere (a 0 here would fire the alerts).
            for url in metrics:
                assert "flywheel_trainer_importance_weight " not in httpx.get(url, timeout=60).text
            buf.put(synthetic_groups(tiny_model_dir, n_groups=2, seed=0))
            for rank, proc in enumerate(procs):
                assert proc.wait(timeout=300) == 0, logs[rank].read_text()[-3000:]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    final = (tmp_path / "t" / "t" / "trainer_metrics.prom").read_text()
    assert "flywheel_trainer_importance_weight " in final  # rank 0 after its step
