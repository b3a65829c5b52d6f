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
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.buffer.client import BufferClient
from services.common.config import FlywheelConfig
from services.common.redis_server import RedisServer, free_port
from services.core.types import SamplingParams
from services.rollout.client import RolloutClient
from services.trainer.control import Control
from services.trainer.io_loop import IOLoop
from services.trainer.logprobs import token_logprobs
from services.trainer.loop import TrainerLoop
from services.trainer.parity import PARITY_FILE, ParityProbe
from services.trainer.paths import RunPaths
from services.trainer.ppo import PPOTrainer
from services.trainer.step_records import PENDING_RECORDS_DIR
from services.trainer.weight_sync import (
    LATEST_FILE,
    WeightPublisher,
    group_layout,
    replica_ranks,
    version_dir,
)
from tests.trainer.helpers import synthetic_groups, trainer_config
from tests.trainer.services import running_buffer, running_replica

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
        # The replica loads disk updates from here only: the tests publish into folders of it.
        f"trainer.weight_dir={root}",
    )
    with running_replica(cfg, root) as address:
        io = IOLoop("test-wsync")
        try:
            trainer = PPOTrainer(cfg)
            yield {"cfg": cfg, "trainer": trainer, "io": io, "root": root, "address": address}
        finally:
            io.close()
            # Free the trainer side of the weights group (its TCPStore host) so the
            # replica's leaving barrier fails fast instead of waiting for its timeout.
            gc.collect()


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


def _next_version(setup: dict) -> int:
    """Versions only move forward on a replica: publish above whatever it serves now."""

    async def served() -> int:
        async with RolloutClient(setup["address"]) as c:
            return await c.get_version()

    return setup["io"].run(served(), timeout=30) + 1


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


def test_service_loop_publishes_every_step_in_sync_mode(
    setup: dict, tiny_model_dir: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    """The whole loop (buffer claim -> train -> ack -> version -> publish) with eta = 0:
    the replica is paused around the update and serves each new version afterwards; the
    parity probe runs once it decodes again and finds it computing what the trainer does.
    Its own fresh replica (version 0): the module's replica has taken other tests'
    versions by the time xdist may run this one."""
    io: IOLoop = setup["io"]
    cfg = trainer_config(
        tiny_model_dir,
        tmp_path,
        f"services.rollout.port={free_port()}",
        f"services.rollout.metrics_port={free_port()}",
        "rollout.weight_update_timeout=60",
        "rollout.max_head_offpolicyness=0",
        "rollout.consumer_batch_size=2",
        "total_train_steps=2",
        "trainer.save_freq_steps=null",
        "trainer.claim_wait_ms=100",
        f"gconfig.temperature={TEMPERATURE}",
        f"actor.temperature={TEMPERATURE}",
    )
    with running_replica(cfg, tmp_path) as address, running_buffer(cfg, redis_server.url) as buf:
        buf.put(synthetic_groups(tiny_model_dir, n_groups=2, seed=5))
        # eta = 0: the second batch is admitted once the buffer moved to version 1.
        second = synthetic_groups(tiny_model_dir, n_groups=2, seed=6, version=1)
        services = cfg.services.model_copy(
            update={"buffer": cfg.services.buffer.model_copy(update={"port": buf.port})}
        )
        cfg = cfg.model_copy(update={"services": services})
        paths = RunPaths.from_config(cfg)

        async def clients():
            return (
                BufferClient(cfg.services.buffer.address),
                WeightPublisher(
                    cfg,
                    weight_dir=paths.weight_dir,
                    parity=ParityProbe.from_config(cfg, log_path=paths.run_dir / PARITY_FILE),
                ),
            )

        buffer, publisher = io.run(clients(), timeout=30)
        loop = TrainerLoop(
            cfg,
            PPOTrainer(cfg),
            paths=paths,
            control=Control(total_train_steps=2, world_size=1),
            io=io,
            buffer=buffer,
            publisher=publisher,
            on_ready=lambda: None,
        )
        original = loop._train_step

        def train_then_feed(groups, *, wait_batch):
            original(groups, wait_batch=wait_batch)
            if loop.trainer.step == 1:
                assert buf.put(second) == ["admitted", "admitted"]

        loop._train_step = train_then_feed  # type: ignore[method-assign]
        try:
            assert loop.run() == 0
        finally:
            io.run(buffer.close(), timeout=10)
            io.run(publisher.close(), timeout=10)
        assert buf.call(buf.client.get_version()) == 2

        async def replica_state():
            async with RolloutClient(address) as c:
                return await c.stats()

        stats = io.run(replica_state(), timeout=30)
    assert stats.version == 2 and not stats.paused  # resumed after the last update
    lines = [json.loads(x) for x in paths.metrics_jsonl.read_text().splitlines()]
    assert [r["version"] for r in lines] == [1, 2]
    assert all(r["replicas_updated"] == 1 and r["replicas_failed"] == [] for r in lines)
    assert all(r["phase_seconds"]["broadcast"] > 0 for r in lines)
    probes = [json.loads(x) for x in (paths.run_dir / PARITY_FILE).read_text().splitlines()]
    assert [(p["version"], p["ok"]) for p in probes] == [(1, True), (2, True)]
    # The disk transport left the newest version's directory for late replicas.
    assert (paths.weight_dir / LATEST_FILE).read_text() == version_dir(paths.weight_dir, 2).name


def test_asynchronous_loop_publishes_in_the_background_without_tearing(
    setup: dict, tiny_model_dir: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    """eta = 1 with `trainer.overlap_weight_publication`: the trainer starts step 2 while
    version 1 is still being published (the publication is held on a gate until step 2 has
    begun, so this does not depend on timing), each step's record is written once its
    publication is complete, the run does not end before the last version is served, and
    every published directory holds exactly the trainer's weights after that step, not a
    mix with the next step's in-place optimizer update."""
    import asyncio
    import threading

    from services.common.weights.disk import load_weights

    io: IOLoop = setup["io"]
    steps = 3
    cfg = trainer_config(
        tiny_model_dir,
        tmp_path,
        f"services.rollout.port={free_port()}",
        f"services.rollout.metrics_port={free_port()}",
        "rollout.weight_update_timeout=60",
        "rollout.max_head_offpolicyness=1",
        "rollout.consumer_batch_size=2",
        f"total_train_steps={steps}",
        "trainer.save_freq_steps=null",
        "trainer.claim_wait_ms=100",
        "trainer.keep_weight_versions=3",
        f"gconfig.temperature={TEMPERATURE}",
        f"actor.temperature={TEMPERATURE}",
    )
    assert cfg.trainer.overlap_weight_publication  # the default
    with running_replica(cfg, tmp_path) as address, running_buffer(cfg, redis_server.url) as buf:
        buf.put(synthetic_groups(tiny_model_dir, n_groups=2, seed=5))
        services = cfg.services.model_copy(
            update={"buffer": cfg.services.buffer.model_copy(update={"port": buf.port})}
        )
        cfg = cfg.model_copy(update={"services": services})
        paths = RunPaths.from_config(cfg)

        async def clients():
            return (
                BufferClient(cfg.services.buffer.address),
                WeightPublisher(
                    cfg,
                    weight_dir=paths.weight_dir,
                    parity=ParityProbe.from_config(cfg, log_path=paths.run_dir / PARITY_FILE),
                ),
            )

        buffer, publisher = io.run(clients(), timeout=30)
        gate = threading.Event()
        publish = publisher.publish

        async def gated_publish(sd, version, **kw):
            if version == 1:  # held until the trainer has started step 2
                assert await asyncio.to_thread(gate.wait, 120)
            return await publish(sd, version, **kw)

        publisher.publish = gated_publish  # type: ignore[method-assign]
        loop = TrainerLoop(
            cfg,
            PPOTrainer(cfg),
            paths=paths,
            control=Control(total_train_steps=steps, world_size=1),
            io=io,
            buffer=buffer,
            publisher=publisher,
            on_ready=lambda: None,
        )
        original = loop._train_step
        trained: dict[int, dict[str, torch.Tensor]] = {}
        in_flight_at_step_2: list[bool] = []

        def train_then_feed(groups, *, wait_batch):
            if loop.trainer.step == 1:
                pending = loop._pending
                in_flight_at_step_2.append(
                    pending is not None and pending.version == 1 and not pending.publication.done()
                )
                gate.set()
            original(groups, wait_batch=wait_batch)
            step = loop.trainer.step
            trained[step] = {
                k: t.detach().clone() for k, t in loop.trainer.actor.full_state_dict().items()
            }
            if step < steps:
                fresh = synthetic_groups(tiny_model_dir, n_groups=2, seed=5 + step, version=step)
                assert buf.put(fresh) == ["admitted", "admitted"]

        loop._train_step = train_then_feed  # type: ignore[method-assign]
        try:
            assert loop.run() == 0
        finally:
            gate.set()
            io.run(buffer.close(), timeout=10)
            io.run(publisher.close(), timeout=10)

        async def served() -> int:
            async with RolloutClient(address) as c:
                return await c.get_version()

        served_version = io.run(served(), timeout=30)
    assert in_flight_at_step_2 == [True]
    assert served_version == steps  # the last publication finished before run() returned
    lines = [json.loads(x) for x in paths.metrics_jsonl.read_text().splitlines()]
    assert [(r["step"], r["version"]) for r in lines] == [(1, 1), (2, 2), (3, 3)]
    assert all(r["replicas_updated"] == 1 and r["replicas_failed"] == [] for r in lines)
    assert all("publish_wait" in r["phase_seconds"] for r in lines)
    assert not paths.metrics_jsonl.with_name(PENDING_RECORDS_DIR).exists()  # all written
    probes = [json.loads(x) for x in (paths.run_dir / PARITY_FILE).read_text().splitlines()]
    assert [(p["version"], p["ok"]) for p in probes] == [(1, True), (2, True), (3, True)]
    for version in range(1, steps + 1):
        published, _ = load_weights(version_dir(paths.weight_dir, version))
        assert published.keys() == trained[version].keys()
        for name, tensor in trained[version].items():
            assert torch.equal(published[name], tensor), (version, name)
    # Training moved the weights, so the comparison above could tell the versions apart.
    assert any(not torch.equal(trained[1][n], trained[2][n]) for n in trained[1])


@pytest.mark.parametrize("transport", ["disk", "grpc", "distributed"])
def test_published_weights_give_the_trainers_logprobs(setup: dict, transport: str) -> None:
    cfg: FlywheelConfig = setup["cfg"]
    trainer: PPOTrainer = setup["trainer"]
    io: IOLoop = setup["io"]
    # One step moves the weights away from the replica's initial copy.
    trainer.train_batch(synthetic_groups(Path(cfg.actor.path), n_groups=2))
    sd = trainer.actor.full_state_dict()
    version = _next_version(setup)
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
    version = _next_version(setup)

    async def publish():
        pub = WeightPublisher(
            cfg, weight_dir=setup["root"] / "w-dead", addresses=[setup["address"], dead]
        )
        try:
            report = await pub.publish(sd, version)
            return report, pub.failures_total, set(pub.unhealthy)
        finally:
            await pub.close()

    report, failures, unhealthy = setup["io"].run(publish(), timeout=180)
    assert report.updated == [setup["address"]]
    assert list(report.failed) == [dead]
    assert failures == 1
    assert unhealthy == {dead}


# ------------------------------------------------------ ranks of tensor-parallel replicas


def test_group_layout_gives_every_tp_worker_its_own_rank(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """SGLang ranks each TP worker at `rank_offset + tp_rank`
    (`sglang/srt/model_executor/model_runner_components/weight_updater.py`
    `init_weights_update_group`). Two replicas of tp_size 2 behind trainer rank 0:
    replica 0 -> ranks 1, 2 (offset 1), replica 1 -> ranks 3, 4 (offset 1 + 2 = 3),
    world = 1 + 2 * 2 = 5. With tp_size 1 it is the old 1..N layout."""
    assert group_layout(2, 2) == (5, [1, 3])
    assert group_layout(3, 1) == (4, [1, 2, 3])
    assert group_layout(1, 8) == (9, [1])
    with pytest.raises(ValueError, match=">= 1"):
        group_layout(0, 2)
    sglang = trainer_config(
        tiny_model_dir, tmp_path, "rollout.engine=sglang", "rollout.sglang.tp_size=4"
    )
    assert replica_ranks(sglang) == 4
    # The torch engine holds one rank whatever tp_size says.
    torch_cfg = trainer_config(tiny_model_dir, tmp_path, "rollout.sglang.tp_size=4")
    assert replica_ranks(torch_cfg) == 1


async def test_sglang_tp_replicas_are_asked_for_offset_plus_tp_rank(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Two real rollout servicers (gRPC on loopback), each with the SGLang client engine in
    front of a tp_size=2 stand-in that checks the rank layout (and records the group
    without joining it, so the trainer's rendezvous then times out and the publication
    reports the replicas failed: what is checked is what each replica was asked)."""
    from flywheel_proto.v1 import rollout_pb2_grpc
    from services.common.grpc_server import ServiceServer
    from services.rollout.engine.sglang_engine import SGLangEngine
    from services.rollout.metrics import RolloutMetrics
    from services.rollout.servicer import RolloutServicer
    from tests.rollout.sglang_standin import SGLangStandIn

    standins = [SGLangStandIn(tiny_model_dir, tp_size=2, join_groups=False) for _ in range(2)]
    engines, servers, addresses = [], [], []
    for i, s in enumerate(standins):
        s.start()
        eng = SGLangEngine(s.url, model_path=str(tiny_model_dir), tp_size=2)
        await eng.start()
        server = ServiceServer("rollout", service_names=["flywheel.v1.RolloutService"])
        servicer = RolloutServicer(eng, rollout_id=f"rollout-{i}", metrics=RolloutMetrics())
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, server.server)
        addresses.append(f"127.0.0.1:{await server.start()}")
        engines.append(eng)
        servers.append(server)
    cfg = trainer_config(
        tiny_model_dir,
        tmp_path,
        "rollout.engine=sglang",
        "rollout.sglang.tp_size=2",
        "rollout.n_replicas=2",
        "trainer.weight_transport=distributed",
        "rollout.weight_update_timeout=5",
    )
    pub = WeightPublisher(cfg, weight_dir=tmp_path / "w", addresses=addresses)
    try:
        sd = {"model.norm.weight": torch.ones(4)}
        report = await pub.publish(sd, 1)
    finally:
        await pub.close()
        for eng, server, s in zip(engines, servers, standins, strict=True):
            await eng.stop()
            await server.stop(grace=1)
            s.stop()
    inits = [s.bodies("/init_weights_update_group") for s in standins]
    assert [[b["rank_offset"] for b in i] for i in inits] == [[1], [3]]
    assert {b["world_size"] for i in inits for b in i} == {5}
    assert [s.group_ranks["flywheel_weights"] for s in standins] == [[1, 2], [3, 4]]
    assert all(s.contract_errors == [] for s in standins)
    assert set(report.failed) == set(addresses)  # nobody joined the trainer's rendezvous


# ---------------------------------------- a replica alive but silent does not hold the trainer


def _replica_pid(setup: dict) -> int:
    """The pid of the module's rollout replica (started on `<root>/rollout.yaml`)."""
    config = str(setup["root"] / "rollout.yaml").encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"services.rollout" in argv and config in argv:
            return int(entry.name)
    raise AssertionError(f"no rollout replica started on {config!r}")


@pytest.mark.parametrize("transport", ["disk", "grpc"])
def test_a_stopped_replica_fails_its_deadline_is_skipped_and_caught_up(
    setup: dict, transport: str
) -> None:
    """SIGSTOP of the real replica process: it keeps its socket (connections are accepted,
    nothing answers). A publication with `rollout.weight_update_timeout=2` reports it failed
    at its deadline (retries included) and marks it unhealthy; the next one skips it after a
    version probe; after SIGCONT the next one gives it the newest weights."""
    import os
    import signal

    base: FlywheelConfig = setup["cfg"]
    cfg = base.model_copy(
        update={
            "trainer": base.trainer.model_copy(update={"weight_transport": transport}),
            "rollout": base.rollout.model_copy(update={"weight_update_timeout": 2.0}),
        }
    )
    trainer: PPOTrainer = setup["trainer"]
    sd = trainer.actor.full_state_dict()
    address = setup["address"]
    version = _next_version(setup)
    pid = _replica_pid(setup)

    async def publish_three():
        pub = WeightPublisher(cfg, weight_dir=setup["root"] / f"w-stop-{transport}")
        reports = []
        try:
            os.kill(pid, signal.SIGSTOP)
            try:
                reports.append(await pub.publish(sd, version))
                reports.append(await pub.publish(sd, version + 1))
            finally:
                os.kill(pid, signal.SIGCONT)
            # The catch-up gets the module's 60 s, not 2 s: the resumed replica first works
            # off what queued up while it was stopped, on a machine that may be loaded.
            pub.cfg = cfg.model_copy(update={"rollout": base.rollout})
            for client in pub.clients.values():
                client.weight_update_timeout = client.timeout = base.rollout.weight_update_timeout
            reports.append(await pub.publish(sd, version + 2))
            return reports, pub.failures_total, set(pub.unhealthy)
        finally:
            await pub.close()

    # The bound only guards a hang of the test; three deadlines of 2 s are far below it.
    (hung, skipped, back), failures, unhealthy = setup["io"].run(publish_three(), timeout=120)
    assert hung.updated == [] and list(hung.failed) == [address]
    assert "rollout.weight_update_timeout=2s" in hung.failed[address]
    assert skipped.updated == [] and skipped.failed[address].startswith("skipped: no answer")
    assert back.updated == [address] and back.failed == {}
    assert failures == 2 and unhealthy == set()
    served, recomputed, served_version = _sample_and_score(setup, version + 2)
    assert served_version == version + 2
    torch.testing.assert_close(served, recomputed, rtol=1e-4, atol=1e-4)
