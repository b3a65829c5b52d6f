"""Rank supervision: truthful exit codes, failure propagation, and the 2-rank service."""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from services.common.redis_server import RedisServer
from services.trainer.launch import spawn_ranks
from services.trainer.ppo import PPOTrainer
from tests.trainer.helpers import synthetic_groups, trainer_config
from tests.trainer.services import running_buffer, start_trainer, write_config

ROOT = Path(__file__).resolve().parents[2]


def _script(tmp: Path, body: str) -> list[str]:
    path = tmp / "job.py"
    path.write_text(f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n" + textwrap.dedent(body))
    return [sys.executable, str(path)]


def test_failing_rank_fails_the_job_and_stops_the_others(tmp_path: Path) -> None:
    marker = tmp_path / "rank0-finished"
    cmd = _script(
        tmp_path,
        f"""
        import os, time
        if os.environ["RANK"] == "1":
            sys.exit(3)
        time.sleep(600)  # rank 0 would wait for a collective that never comes
        open({str(marker)!r}, "w").write("x")
        """,
    )
    assert spawn_ranks([], 2, command=cmd) == 3
    assert not marker.exists()  # rank 0 was terminated, not left running


def test_ranks_after_gloo_collectives_exit_zero(tmp_path: Path) -> None:
    cmd = _script(
        tmp_path,
        """
        import torch
        import torch.distributed as dist
        from services.trainer.dist import finish, init_distributed
        ctx = init_distributed("cpu")
        t = torch.ones(3) * (ctx.rank + 1)
        dist.all_reduce(t)
        # 1 + 2 = 3 on every element, on both ranks
        finish(0 if t.tolist() == [3.0, 3.0, 3.0] and ctx.world_size == 2 else 5, ctx)
        """,
    )
    assert spawn_ranks([], 2, command=cmd) == 0


@pytest.mark.integration
def test_two_rank_service_trains_what_one_rank_trains(
    tiny_model_dir: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    batches = [
        synthetic_groups(tiny_model_dir, n_groups=2, seed=s, prefix=f"r{s}-") for s in (0, 1)
    ]
    cfg = trainer_config(
        tiny_model_dir,
        tmp_path,
        "trainer.n_ranks=2",
        "total_train_steps=2",
        "trainer.save_freq_steps=null",
        "rollout.consumer_batch_size=2",
        "rollout.max_head_offpolicyness=10",
        "actor.ppo_n_minibatches=2",
    )
    with running_buffer(cfg, redis_server.url) as buf:
        services = cfg.services.model_copy(
            update={"buffer": cfg.services.buffer.model_copy(update={"port": buf.port})}
        )
        cfg = cfg.model_copy(update={"services": services})
        for b in batches:
            buf.put(b)
        log = tmp_path / "trainer.log"
        proc = start_trainer(write_config(cfg, tmp_path / "cfg.yaml"), log_path=log)
        assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
        assert buf.call(buf.client.stats()).acked_total == 4
    lines = [json.loads(x) for x in (tmp_path / "t/t/metrics.jsonl").read_text().splitlines()]
    assert [r["group_ids"] for r in lines] == [[g.group_id for g in b] for b in batches]
    # The same two batches through a one-rank trainer in this process.
    single = PPOTrainer(trainer_config(tiny_model_dir, tmp_path, "actor.ppo_n_minibatches=2"))
    for line, batch in zip(lines, batches, strict=True):
        r = single.train_batch(batch)
        torch.testing.assert_close(line["losses"], r.minibatch_losses, rtol=1e-5, atol=1e-6)


def test_an_incomplete_stop_exits_with_the_stopped_code_a_completed_run_with_0(
    tmp_path: Path,
) -> None:
    from services.trainer.__main__ import _final_code
    from services.trainer.lifecycle import write_completion
    from services.trainer.paths import RunPaths

    cfg = trainer_config(tmp_path / "model", tmp_path, "total_train_steps=4")
    assert _final_code(0, cfg, 0) == 0  # without the option: 0, as before
    assert _final_code(0, cfg, 75) == 75  # stopped at step < 4: a Job must run it again
    assert _final_code(1, cfg, 75) == 1  # a failure keeps its own code
    write_completion(
        RunPaths.from_config(cfg), step=4, version=4, total_train_steps=4, checkpoint=None
    )
    assert _final_code(0, cfg, 75) == 0  # complete: done


def test_node_ranks_of_a_multi_node_job(tmp_path: Path) -> None:
    """Node 1 of 2 with 2 ranks each runs global ranks 2 and 3 as local ranks 0 and 1 of a
    4-rank job, as `torchrun --nnodes 2 --node-rank 1 --nproc-per-node 2` would."""
    out = tmp_path / "env"
    out.mkdir()
    cmd = _script(
        tmp_path,
        f"""
        import os
        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
        line = " ".join(os.environ[k] for k in keys)
        open(os.path.join({str(out)!r}, os.environ["RANK"]), "w").write(line)
        """,
    )
    code = spawn_ranks([], 4, nproc_per_node=2, node_rank=1, master_port=29999, command=cmd)
    assert code == 0
    assert {p.name: p.read_text() for p in out.iterdir()} == {"2": "2 0 4 2", "3": "3 1 4 2"}


@pytest.mark.integration
def test_sigterm_to_the_supervisor_ends_with_a_final_checkpoint_and_exit_0(
    tiny_model_dir: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    """The chart's trainer container: `python -m services.trainer --nproc-per-node 2
    --grace G` as the main process (in place of torchrun, which kills its workers 30 s
    after SIGTERM and exits 1). SIGTERM mid-run: rank 0 finishes the step, writes the final
    checkpoint, both ranks leave and the supervisor exits 0 within the grace."""
    import signal

    cfg = trainer_config(
        tiny_model_dir,
        tmp_path,
        "trainer.n_ranks=2",
        "total_train_steps=50",
        "trainer.save_freq_steps=100",  # no periodic save before the stop; save_on_exit
        "rollout.consumer_batch_size=2",
        "rollout.max_head_offpolicyness=10",
        "trainer.claim_wait_ms=100",
    )
    jsonl = tmp_path / "t" / "t" / "metrics.jsonl"
    with running_buffer(cfg, redis_server.url) as buf:
        services = cfg.services.model_copy(
            update={"buffer": cfg.services.buffer.model_copy(update={"port": buf.port})}
        )
        cfg = cfg.model_copy(update={"services": services})
        buf.put(synthetic_groups(tiny_model_dir, n_groups=2, seed=0))
        log = tmp_path / "trainer.log"
        proc = start_trainer(
            write_config(cfg, tmp_path / "cfg.yaml"),
            "--nproc-per-node",
            "2",
            "--grace",
            "240",
            log_path=log,
        )
        deadline = time.monotonic() + 300  # guards a hang; not a timing assertion
        while not (jsonl.exists() and jsonl.read_text().strip()):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    steps = [json.loads(x)["step"] for x in jsonl.read_text().splitlines()]
    assert steps == [1]  # one batch, one step; then it waited for data until the signal
    ckpt = tmp_path / "t" / "t" / "checkpoints" / "step_00000001" / "trainer_state.json"
    assert ckpt.is_file(), log.read_text()[-3000:]
