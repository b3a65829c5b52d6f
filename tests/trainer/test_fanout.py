"""The two-level weight fan-out: its plan (pure), its config rules, and four real replicas.

The integration tests run four real rollout replicas (`python -m services.rollout
--eval-only`, torch engine, the tiny model), two per simulated node
(`trainer.weight_fanout_replicas_per_node: 2`), and publish from this process over real gloo
groups on loopback. A replica reports the SHA-256 of the weights it serves (`Stats`), which
must be the trainer's manifest checksum: every replica bit-identical to what was sent.
"""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.common.config import FlywheelConfig
from services.common.config.errors import ConfigError
from services.common.tiny_model import write_tiny_model
from services.common.weights.manifest import make_manifest, named_parameters_for_update
from services.rollout.client import RolloutClient
from services.trainer.fanout import (
    FormedGroup,
    NodePlan,
    node_of,
    plan_nodes,
    stale_groups,
)
from services.trainer.io_loop import IOLoop
from services.trainer.weight_sync import WeightPublisher
from tests.trainer.helpers import trainer_config
from tests.trainer.services import ROOT, wait_serving, write_config

A, B, C, D = "h1:1", "h1:2", "h2:1", "h2:2"

# -- the plan ----------------------------------------------------------------------------


def test_nodes_come_from_replicas_per_node_or_the_address_host() -> None:
    addrs = ["r-0:5", "r-1:5", "r-2:5"]
    assert node_of(addrs, 2) == {"r-0:5": "node0", "r-1:5": "node0", "r-2:5": "node1"}
    assert node_of([A, B, C], 0) == {A: "h1", B: "h1", C: "h2"}


def test_the_relay_is_the_first_alive_replica_and_stays_while_it_answers() -> None:
    nodes = node_of([A, B, C, D], 0)
    assert plan_nodes([A, B, C, D], nodes, {}) == [
        NodePlan("h1", (A, B)),
        NodePlan("h2", (C, D)),
    ]
    # A died: B relays for h1. A back: B stays the relay (the trainer's group is not
    # re-formed for a replica coming back).
    assert plan_nodes([B, C, D], nodes, {"h1": A, "h2": C})[0] == NodePlan("h1", (B,))
    assert plan_nodes([A, B, C, D], nodes, {"h1": B, "h2": C})[0] == NodePlan("h1", (B, A))


def test_only_the_changed_groups_are_stale() -> None:
    plans = [NodePlan("h1", (A, B)), NodePlan("h2", (C, D))]
    top = FormedGroup("t", (A, C), delivered=3)
    nodes = {"h1": FormedGroup("n1", (A, B), 3), "h2": FormedGroup("n2", (C, D), 3)}
    served: dict[str, int | None] = {A: 3, B: 3, C: 3, D: 3}
    assert stale_groups(plans, top, nodes, served) == (False, [])
    # D restarted (serves 0 < 3): h2's group only.
    assert stale_groups(plans, top, nodes, {**served, D: 0}) == (False, [plans[1]])
    # C (h2's relay) restarted: the trainer's group and h2's.
    assert stale_groups(plans, top, nodes, {**served, C: 0}) == (True, [plans[1]])
    # D gone: h2 has its relay alone, which needs no group of its own.
    assert stale_groups([plans[0], NodePlan("h2", (C,))], top, nodes, served) == (False, [])
    # No groups yet: all of them.
    assert stale_groups(plans, None, {}, served) == (True, plans)


# -- config rules ------------------------------------------------------------------------


def test_two_level_is_refused_outside_the_distributed_transport(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match="weight_fanout.*weight_transport: distributed"):
        trainer_config(tiny_model_dir, tmp_path, "trainer.weight_fanout=two_level")
    with pytest.raises(ConfigError, match="torch engine"):
        trainer_config(
            tiny_model_dir,
            tmp_path,
            "trainer.weight_transport=distributed",
            "trainer.weight_fanout=two_level",
            "rollout.engine=sglang",
        )
    with pytest.raises(ConfigError, match="weight_fanout"):
        trainer_config(tiny_model_dir, tmp_path, "trainer.weight_fanout=tree")
    cfg = trainer_config(
        tiny_model_dir,
        tmp_path,
        "trainer.weight_transport=distributed",
        "trainer.weight_fanout=two_level",
    )
    assert cfg.trainer.weight_fanout == "two_level"
    assert trainer_config(tiny_model_dir, tmp_path).trainer.weight_fanout == "flat"


# -- four real replicas in two simulated nodes -------------------------------------------

N_REPLICAS = 4


def _consecutive_ports(n: int) -> int:
    """A base port with the n ports from it free (replica i listens on base + i)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return base
    raise RuntimeError("no run of free ports")


class Replicas:
    """The replica processes of one config, each restartable."""

    def __init__(self, cfg: FlywheelConfig, root: Path) -> None:
        self.cfg = cfg
        self.root = root
        self.path = write_config(cfg, root / "rollout.yaml")
        self.procs: dict[int, subprocess.Popen] = {}

    def address(self, i: int) -> str:
        return self.cfg.services.rollout.replica_address(i)

    def start(self, i: int) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        log_path = self.root / f"rollout-{i}.log"
        cmd = [sys.executable, "-m", "services.rollout", "--config", str(self.path)]
        self.procs[i] = subprocess.Popen(
            [*cmd, "--replica-index", str(i), "--eval-only"],
            cwd=ROOT,
            env=env,
            stdout=log_path.open("ab"),
            stderr=subprocess.STDOUT,
        )

    def wait(self, i: int) -> None:
        wait_serving(self.address(i), self.procs[i], self.root / f"rollout-{i}.log")

    def stop(self, i: int) -> None:
        proc = self.procs.pop(i)
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def fleet(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("fanout")
    cfg = trainer_config(
        tiny_model_dir,
        root,
        f"services.rollout.port={_consecutive_ports(N_REPLICAS)}",
        f"services.rollout.metrics_port={_consecutive_ports(N_REPLICAS)}",
        f"rollout.n_replicas={N_REPLICAS}",
        "rollout.weight_update_timeout=60",
        "trainer.weight_transport=distributed",
        "trainer.weight_fanout=two_level",
        "trainer.weight_fanout_replicas_per_node=2",
        "trainer.weight_bucket_bytes=8192",  # the tiny model's 0.2 MB in ~25 buckets
    )
    replicas = Replicas(cfg, root)
    io = IOLoop("test-fanout")
    publisher: WeightPublisher | None = None
    try:
        for i in range(N_REPLICAS):
            replicas.start(i)
        for i in range(N_REPLICAS):
            replicas.wait(i)

        async def make() -> WeightPublisher:  # gRPC aio channels belong to the io loop
            return WeightPublisher(cfg, weight_dir=root / "weights")

        publisher = io.run(make(), timeout=30)
        yield {"cfg": cfg, "replicas": replicas, "io": io, "publisher": publisher, "root": root}
    finally:
        if publisher is not None:
            io.run(publisher.close(), timeout=30)
        for i in list(replicas.procs):
            replicas.stop(i)
        io.close()
        gc.collect()


def _weights(root: Path, seed: int) -> dict[str, torch.Tensor]:
    """New weights for the tiny architecture: the model written with another seed."""
    from transformers import AutoModelForCausalLM

    path = write_tiny_model(root / f"model-{seed}", seed=seed)
    return named_parameters_for_update(AutoModelForCausalLM.from_pretrained(path))


def _publish_and_check(fleet: dict, seed: int, down: tuple[int, ...] = ()) -> None:
    """Publish weights of `seed` above every served version; every replica but those `down`
    must answer with that version and report the manifest's checksum as the one it serves."""
    publisher: WeightPublisher = fleet["publisher"]
    replicas: Replicas = fleet["replicas"]
    io: IOLoop = fleet["io"]
    up = [replicas.address(i) for i in range(N_REPLICAS) if i not in down]
    sd = _weights(fleet["root"], seed)
    served = io.run(publisher.versions(), timeout=120)
    version = max(v or 0 for v in served.values()) + 1
    report = io.run(publisher.publish(sd, version), timeout=180)
    assert sorted(report.failed) == sorted(replicas.address(i) for i in down), report.failed
    assert sorted(report.updated) == sorted(up)

    async def stats() -> list[tuple[int, str]]:
        out = []
        for a in up:
            async with RolloutClient(a) as c:
                s = await c.stats()
                out.append((s.version, s.checksum))
        return out

    checksum = make_manifest(sd, version).checksum
    assert io.run(stats(), timeout=60) == [(version, checksum)] * len(up)


def _groups(publisher: WeightPublisher) -> tuple[FormedGroup, dict[str, FormedGroup]]:
    fanout = publisher.fanout
    assert fanout is not None and fanout.top is not None
    return fanout.top, dict(fanout.node_groups)


@pytest.mark.integration
@pytest.mark.slow
def test_every_replica_gets_the_trainers_bytes_through_its_relay(fleet: dict) -> None:
    replicas: Replicas = fleet["replicas"]
    r = [replicas.address(i) for i in range(N_REPLICAS)]
    _publish_and_check(fleet, seed=11)
    top, nodes = _groups(fleet["publisher"])
    # The trainer's group holds one relay per node, each node's group its relay first.
    assert top.ranks == (r[0], r[2])
    assert {n: g.ranks for n, g in nodes.items()} == {"node0": (r[0], r[1]), "node1": (r[2], r[3])}
    # A second update goes through the same groups (none is formed again).
    _publish_and_check(fleet, seed=12)
    top2, nodes2 = _groups(fleet["publisher"])
    assert top2.name == top.name
    assert {n: g.name for n, g in nodes2.items()} == {n: g.name for n, g in nodes.items()}


@pytest.mark.integration
@pytest.mark.slow
def test_a_restarted_member_re_forms_its_nodes_group_only(fleet: dict) -> None:
    replicas: Replicas = fleet["replicas"]
    _publish_and_check(fleet, seed=13)
    top, nodes = _groups(fleet["publisher"])
    replicas.stop(3)  # node1's member: its server comes back without the group or weights
    replicas.start(3)
    replicas.wait(3)
    _publish_and_check(fleet, seed=14)
    top2, nodes2 = _groups(fleet["publisher"])
    assert top2.name == top.name  # the trainer's group is untouched
    assert nodes2["node0"].name == nodes["node0"].name  # so is the other node's
    assert nodes2["node1"].name != nodes["node1"].name
    assert nodes2["node1"].ranks == nodes["node1"].ranks


@pytest.mark.integration
@pytest.mark.slow
def test_a_dead_relay_hands_its_node_to_the_next_replica(fleet: dict) -> None:
    replicas: Replicas = fleet["replicas"]
    r = [replicas.address(i) for i in range(N_REPLICAS)]
    _publish_and_check(fleet, seed=15)
    _, nodes = _groups(fleet["publisher"])
    replicas.stop(0)  # node0's relay
    _publish_and_check(fleet, seed=16, down=(0,))
    top, nodes2 = _groups(fleet["publisher"])
    assert top.ranks == (r[1], r[2])  # r1 relays for node0, alone there
    assert "node0" not in nodes2
    assert nodes2["node1"].name == nodes["node1"].name
    replicas.start(0)
    replicas.wait(0)
    # The event the trainer acts on is its own channel answering again: a channel that saw
    # the replica refuse connections reconnects after a backoff (up to 2 s), and on loaded
    # cores that can outlast the 5 s probe that lets an unhealthy replica rejoin.
    fleet["io"].run(fleet["publisher"].clients[r[0]].get_version(), timeout=120)
    _publish_and_check(fleet, seed=17)
    top2, nodes3 = _groups(fleet["publisher"])
    # The replica that came back joins as a member: r1 keeps the relay's place, so the
    # trainer's group and node1's are not formed again.
    assert top2.name == top.name and top2.ranks == (r[1], r[2])
    assert nodes3["node0"].ranks == (r[1], r[0])
    assert nodes3["node1"].name == nodes["node1"].name
