"""Experiment tracking (`services/trainer/tracking.py`): TensorBoard, W&B, MLflow under
AReaL's metric names (`areal/trainer/ppo/actor.py`: the `ppo_actor` scope and its `update`
sub-scope; `areal/workflow/rlvr.py`: `rollout/reward`; `areal/utils/stats_tracker.py`:
`<key>/avg|min|max`). W&B and MLflow run offline: nothing leaves the machine."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from services.common.config import load_config
from services.common.redis_server import RedisServer, free_port
from services.trainer.tracking import Tracker, areal_metrics
from tests.trainer.helpers import synthetic_groups, trainer_config
from tests.trainer.services import running_buffer, start_trainer, write_config

tensorboard = pytest.importorskip("tensorboard", reason="the `tracking` extra is not installed")

from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    EventAccumulator,
)

RECORD: dict[str, Any] = {
    "step": 3,
    "version": 3,
    "task_reward": 0.25,
    "no_eos_ratio": 0.5,
    "loss": -0.1,
    "grad_norm": 2.0,
    "lr": 1e-3,
    "step_seconds": 1.5,
    "phase_seconds": {"train": 1.0, "claim": 0.25},
    "samples": 8,
    "group_ids": ["a", "b"],
    "stats": {
        "importance_weight/avg": 1.0,
        "importance_weight/max": 1.25,
        "approx_kl/avg": 0.01,
        "actor_loss": -0.1,
        "actor_loss/avg": -0.1,
        "task_reward": 0.25,
        "no_eos_ratio": 0.5,
        "shaped_reward": 2.0,
        "n_seqs": 8,
        "staleness_max": 1.0,
        "n_total_tokens": 40.0,
        "n_masked_tokens": 26.0,
        "masked_token_ratio": 0.65,
    },
}


def test_step_records_are_named_as_areal_names_them() -> None:
    got = areal_metrics(RECORD)
    want = {
        "ppo_actor/update/importance_weight/avg": 1.0,
        "ppo_actor/update/importance_weight/max": 1.25,
        "ppo_actor/update/approx_kl/avg": 0.01,
        "ppo_actor/update/actor_loss/avg": -0.1,
        "ppo_actor/update/grad_norm": 2.0,
        "ppo_actor/update/lr": 1e-3,
        "ppo_actor/task_reward/avg": 0.25,
        "ppo_actor/no_eos_ratios/avg": 0.5,  # AReaL's seq_stats key is `no_eos_ratios`
        "ppo_actor/final_reward/avg": 2.0,  # AReaL's `final_reward` = tot_rewards
        "ppo_actor/n_seqs": 8.0,
        # AReaL 2.0 `grpo_loss_fn`: stats_tracker.scalar(n_total_tokens=..., ...) in the
        # ppo_actor/update scope (areal/trainer/ppo/actor.py)
        "ppo_actor/update/n_total_tokens": 40.0,
        "ppo_actor/update/n_masked_tokens": 26.0,
        "ppo_actor/update/masked_token_ratio": 0.65,
        "rollout/reward": 0.25,
        "timeperf/train": 1.0,
        "timeperf/claim": 0.25,
        "flywheel/staleness_max": 1.0,
        "flywheel/samples": 8.0,
    }
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=0, abs=1e-12), name
    assert "flywheel/actor_loss" not in got  # only its /avg|min|max, under update/
    assert not any("group_ids" in k for k in got)


def test_wandb_and_mlflow_offline_receive_the_areal_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(
        None,
        [
            f"cluster.fileroot={tmp_path}",
            "experiment_name=e",
            "trial_name=t",
            "tracking.wandb.mode=offline",
            "tracking.mlflow.mode=offline",
        ],
    )
    run_dir = tmp_path / "e" / "t"
    tracker = Tracker(cfg, run_dir)
    tracker.log(RECORD)
    tracker.log({**RECORD, "step": 4, "stats": {"importance_weight/avg": 0.5}})
    tracker.close()

    client = mlflow.tracking.MlflowClient((run_dir / "mlruns").resolve().as_uri())
    (experiment,) = [x for x in client.search_experiments() if x.name == "e"]
    (run,) = client.search_runs([experiment.experiment_id])
    history = client.get_metric_history(run.info.run_id, "ppo_actor/update/importance_weight/avg")
    assert [(m.step, m.value) for m in history] == [(3, 1.0), (4, 0.5)]
    assert run.data.params["actor.eps_clip"] == "0.2"  # the config travels as parameters

    # The offline run's history, as `wandb sync` would upload it.
    (history_file,) = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    steps = _wandb_history(history_file)
    assert [step for step, _ in steps] == [3, 4]
    assert steps[0][1]["ppo_actor/update/importance_weight/avg"] == 1.0
    assert steps[0][1]["rollout/reward"] == 0.25
    assert steps[1][1]["ppo_actor/update/importance_weight/avg"] == 0.5


def _wandb_history(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(step, metrics) of each history record of a `.wandb` file: a `:W&B` header of 7
    bytes, then LevelDB log records (32 KiB blocks; 7-byte header crc32/length/type; types
    full=1, first=2, middle=3, last=4) holding `wandb_internal_pb2.Record` messages."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    out: list[tuple[int, dict[str, Any]]] = []
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (2, 3):
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        if record.WhichOneof("record_type") == "history":
            items = {
                (i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                for i in record.history.item
            }
            out.append((int(items.get("_step", record.history.step.num)), items))
    return out


def _wait(fn: Any, proc: Any, log: Path, what: str, timeout: float = 300) -> Any:
    deadline = time.monotonic() + timeout  # guards a hang; not a timing assertion
    while True:
        assert proc.poll() is None, f"trainer exited before {what}:\n" + log.read_text()[-3000:]
        value = fn()
        if value:
            return value
        assert time.monotonic() < deadline, f"no {what}:\n" + log.read_text()[-3000:]
        time.sleep(0.2)


@pytest.mark.integration
def test_a_short_run_leaves_tensorboard_events_under_areal_names(
    tiny_model_dir: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    port = free_port()
    cfg = trainer_config(
        tiny_model_dir,
        tmp_path,
        "total_train_steps=2",
        "trainer.save_freq_steps=100",
        "trainer.save_on_exit=false",
        "rollout.consumer_batch_size=2",
        "rollout.max_head_offpolicyness=10",
        "actor.recompute_logprob=true",
        "actor.use_decoupled_loss=true",
        "trainer.claim_wait_ms=100",
        f"services.trainer.port={port}",
        "services.trainer.metrics_port=0",
    )
    run_dir = tmp_path / "t" / "t"
    with running_buffer(cfg, redis_server.url) as buf:
        services = cfg.services.model_copy(
            update={"buffer": cfg.services.buffer.model_copy(update={"port": buf.port})}
        )
        cfg = cfg.model_copy(update={"services": services})
        buf.put(synthetic_groups(tiny_model_dir, n_groups=4, seed=0))
        log = tmp_path / "trainer.log"
        proc = start_trainer(write_config(cfg, tmp_path / "cfg.yaml"), log_path=log)
        # No wait for SERVING: two steps on claimed groups can end the run before a
        # health probe gets in; the exit code and the event files are what is checked.
        assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for name in (
        "ppo_actor/update/importance_weight/avg",
        "ppo_actor/no_eos_ratios/avg",
        "rollout/reward",
        "ppo_actor/update/grad_norm",
        "timeperf/train",
    ):
        assert name in tags, name
    weights = events.Scalars("ppo_actor/update/importance_weight/avg")
    assert [e.step for e in weights] == [1, 2]
    # ppo_n_minibatches=1 with the proximal pass recomputed: the ratio is exactly 1
    # before the only optimizer step (as in tests/trainer/test_service.py).
    assert [e.value for e in weights] == [1.0, 1.0]
    # Every statistic of metrics.jsonl is there: the record's numbers, renamed.
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert set(areal_metrics(lines[-1])) <= tags
    rewards = [e.value for e in events.Scalars("rollout/reward")]
    assert rewards == pytest.approx([r["task_reward"] for r in lines], rel=0, abs=1e-6)
