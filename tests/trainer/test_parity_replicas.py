"""The weight-parity probe with several replicas probed at once (three real rollout replicas,
each its own process with the torch engine, the tiny model, float32 on CPU).

Every replica gets the same clean weights, so every probe must pass: a healthy replica
computes what the trainer computes. The probe compares each replica against a reference
forward on one shared model, and the answers of the replicas come back at about the same
time, so the reference forwards for different replicas run concurrently in the trainer's
threads. A reference that changes the shared model while it runs (swapping the published
tensors in and the model's own back out, per call, as `torch.func.functional_call` does)
lets one replica's forward run on weights another call has just put back: that replica's
difference jumps by tenths of a nat and a healthy replica is paused. Eight updates, each
probed on three replicas, must show no such false alarm.

A smaller GIL switch interval (the interpreter hands the GIL to another thread more often)
makes the interleavings that such a race needs frequent enough to show within these probes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from services.common.config import FlywheelConfig
from services.common.redis_server import free_port
from services.trainer.io_loop import IOLoop
from services.trainer.parity import DEFAULT_TOLERANCE, ParityProbe, hf_reference
from services.trainer.weight_sync import WeightPublisher
from tests.trainer.helpers import trainer_config
from tests.trainer.services import running_replica
from tests.trainer.test_parity import _updated_weights
from tests.trainer.test_parity_reference import frequent_thread_switches  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.slow]

N_REPLICAS = 3
UPDATES = 8


@pytest.fixture(scope="module")
def replicas(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("parity-replicas")
    with ExitStack() as stack:
        addresses = []
        for i in range(N_REPLICAS):
            ports = {"port": free_port(), "metrics_port": free_port()}
            endpoints = [f"services.rollout.{k}={v}" for k, v in ports.items()]
            cfg = trainer_config(tiny_model_dir, root, *endpoints, "trainer.weight_transport=grpc")
            replica_root = root / f"replica-{i}"
            replica_root.mkdir()
            addresses.append(stack.enter_context(running_replica(cfg, replica_root)))
        io = IOLoop("test-parity-replicas")
        stack.callback(io.close)
        yield {"cfg": cfg, "io": io, "root": root, "addresses": addresses}


@pytest.mark.usefixtures("frequent_thread_switches")
def test_concurrent_probes_of_healthy_replicas_raise_no_false_alarm(replicas: dict) -> None:
    cfg: FlywheelConfig = replicas["cfg"]
    addrs: list[str] = replicas["addresses"]
    # Six prompts of 24 tokens per replica: each replica's reference forwards take long
    # enough that those of the three replicas overlap.
    probe = ParityProbe(lambda: hf_reference(cfg), n_prompts=6, prompt_len=24)
    tol = DEFAULT_TOLERANCE["float32"]

    async def run() -> tuple[list[dict[str, float | None]], dict[int, dict[str, str]], list[bool]]:
        pub = WeightPublisher(cfg, weight_dir=replicas["root"] / "w", addresses=addrs, parity=probe)
        rounds, alarms = [], {}
        try:
            for version in range(1, UPDATES + 1):
                sd = _updated_weights(cfg, version)
                report = await pub.publish(sd, version)
                # every replica took the update (one paused by a false alarm is resumed for
                # its next probe, so it takes the next update too)
                assert sorted(report.updated) == sorted(addrs), report.failed
                report = await pub.check_parity(sd, report)
                rounds.append({a: probe.last[a].max_abs_logprob_diff for a in addrs})
                if report.failed:
                    alarms[version] = report.failed
            paused = [(await pub.clients[a].stats()).paused for a in addrs]
        finally:
            await pub.close()
        return rounds, alarms, paused

    rounds, alarms, paused = replicas["io"].run(run(), timeout=600)
    diffs = [d for r in rounds for d in r.values()]
    worst = max(d if d is not None else float("inf") for d in diffs)
    print(
        f"{len(diffs)} probes, {len(alarms)} updates with a false alarm, largest diff {worst:.3g}"
    )
    assert len(diffs) == N_REPLICAS * UPDATES
    assert alarms == {}
    assert all(d is not None and d < tol / 10 for d in diffs), rounds
    assert paused == [False] * N_REPLICAS and probe.excluded == set()
    # every probe compared every token of its replica's answer: 6 prompts x 8 new tokens
    assert all(probe.last[a].tokens == 6 * 8 for a in addrs)
