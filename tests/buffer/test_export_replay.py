"""Export to JSONL and replay of an exported file (services/buffer/export.py, replay.py)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml

from services.buffer.export import group_to_record, read_jsonl, record_to_group
from services.buffer.service import key_prefix, store_settings
from services.buffer.store import RedisStore, connect
from services.common.codec import CodecError, group_to_proto
from services.common.config import BufferConfig, RolloutConfig
from services.common.redis_server import RedisServer

from .helpers import assert_groups_equal, make_group
from .proc import REPO


def test_record_round_trip_is_exact() -> None:
    g = make_group("g", version=3, oldest=1, rewards=(0.25, -1.0, 1e-7))
    g.trajectories[1].turn_ids = np.array([-1, -1, -1, 0, 0, 1, 1])
    rec = json.loads(json.dumps(group_to_record(g)))
    assert (rec["oldest_version"], rec["newest_version"]) == (1, 3)
    assert rec["rewards"] == [0.25, -1.0, 1e-7]
    back = record_to_group(rec)
    assert_groups_equal(back, g)
    np.testing.assert_array_equal(back.trajectories[1].turn_ids, [-1, -1, -1, 0, 0, 1, 1])
    assert back.trajectories[0].turn_ids is None


def test_reading_a_bad_file_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    good = json.dumps(group_to_record(make_group("a")))
    path.write_text(good + "\n\n" + '{"format": "something else"}\n')
    with pytest.raises(CodecError, match=r"x.jsonl:3: not an exported group"):
        list(read_jsonl(path))


@pytest.mark.integration
async def test_export_then_replay_serves_the_same_groups(make_buffer, tmp_path: Path) -> None:
    live, client = await make_buffer(
        buffer={"retain_acked_groups": 100}, rollout={"max_head_offpolicyness": 10}
    )
    groups = {
        "a": make_group("a", version=0),
        "b": make_group("b", version=0, rewards=(1.0, 0.5, 0.0)),
        "c": make_group("c", version=1),
        "d": make_group("d", version=2),
    }
    for g in groups.values():
        await client.put(g)
    await client.set_version(2)
    trained = await client.claim(2, consumer_id="t")
    await client.ack(trained.group_ids)  # a and b: acked, payloads retained
    n, path = await client.export("run/versions-0-1.jsonl", 0, 1)
    assert n == 3 and path == str(Path(live.parts.export_dir, "run/versions-0-1.jsonl"))
    lines = [json.loads(x) for x in Path(path).read_text().splitlines()]
    assert [(x["group_id"], x["state"]) for x in lines] == [
        ("a", "acked"),
        ("b", "acked"),
        ("c", "pending"),
    ]
    for got in read_jsonl(path):
        assert_groups_equal(got, groups[got.group_id])

    replay, rclient = await make_buffer(buffer={"replay_path": path})
    assert not replay.servicer.cache.enabled  # no puts here: claims carry their own bytes
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await rclient.put(make_group("new"))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await rclient.reserve(1)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    await rclient.set_version(50)  # a train-only run at any version: no staleness drops
    out = await rclient.claim(3, consumer_id="debug-trainer")
    assert out.group_ids == ["a", "b", "c"] and out.dropped_stale == 0
    for got in out.groups:
        assert_groups_equal(got, groups[got.group_id])
    assert await rclient.ack(out.group_ids) == 3
    s = await rclient.stats()
    assert (s.put_total, s.acked_total, s.pending, s.replay, s.invariant_ok) == (
        3,
        3,
        0,
        True,
        True,
    )

    live_stats = await client.stats()  # the replay lives under its own prefix
    assert (live_stats.put_total, live_stats.acked_total, live_stats.pending) == (4, 2, 2)
    assert live_stats.version == 2


@pytest.mark.integration
async def test_export_command_line_with_text(tmp_path: Path) -> None:
    """`python -m services.buffer --config F --export OUT` against a Redis with a password,
    with prompt and completion text decoded by the configured tokenizer."""
    from transformers import PreTrainedTokenizerFast  # heavy: only this test needs it

    from services.common.tiny_model import build_tokenizer

    tok = build_tokenizer()
    tok_dir = tmp_path / "tok"
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(tok_dir)
    with RedisServer(password="pa ss", dir=tmp_path / "redis") as secured:
        url = f"redis://127.0.0.1:{secured.port}/0"
        g = make_group("txt", prompt_len=5, gen_len=2, rewards=(1.0,))
        g.trajectories[0].input_ids = np.array([tok.token_to_id(ch) for ch in "12+3=15"])
        settings = store_settings(
            BufferConfig(), RolloutConfig(), key_prefix(BufferConfig(), "cli", "t0")
        )
        store = RedisStore(connect(url, password="pa ss"), settings)
        await store.put(
            group_id="txt",
            oldest_version=0,
            newest_version=0,
            n_trajectories=1,
            payload=group_to_proto(g).SerializeToString(),
        )
        await store.close()
        cfg = tmp_path / "cfg.yaml"
        cfg.write_text(
            yaml.safe_dump(
                {
                    "experiment_name": "cli",
                    "trial_name": "t0",
                    "actor": {"kl_ctl": 0.0},
                    "buffer": {"redis_url": url, "tokenizer_path": str(tok_dir)},
                }
            )
        )
        out = tmp_path / "out.jsonl"
        cmd = [sys.executable, "-m", "services.buffer", "--config", str(cfg), "--export", str(out)]
        env = {**os.environ, "FLYWHEEL_REDIS_PASSWORD": "pa ss"}
        done = await asyncio.to_thread(
            subprocess.run, cmd, cwd=REPO, env=env, capture_output=True, timeout=120
        )
        assert done.returncode == 0, done.stderr.decode()[-2000:]
    (rec,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert rec["group_id"] == "txt"
    assert rec["trajectories"][0]["prompt_text"] == "12+3="
    assert rec["trajectories"][0]["completion_text"] == "15"
