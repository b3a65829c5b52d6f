"""A relay's side of the two-level fan-out: `relay_buckets` over real gloo groups, and
what it does when its node cannot be reached.

The relay runs in its own process (`relay_worker.py`), rank 1 of the trainer's group and
rank 0 of its node's group. This process is both the trainer (rank 0 of the trainer's
group, hosting the one store every group meets in, as the trainer does) and the node's
member (rank 1 of the node's group): a process holds one rank of a given group, and these
are two groups. What the member receives has passed through the relay; it must be the
trainer's bytes in every dtype, bucketed and per tensor, for two updates in a row.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from services.common.weights.distributed import (
    WeightsGroup,
    flatten_bucket,
    host_store,
    make_buckets,
    recv_buckets,
    relay_buckets,
    send_buckets,
)
from services.common.weights.manifest import tensor_specs
from services.trainer.dist import free_port
from tests.common.weights.samples import assert_bit_identical, sample_tensors

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT_S = 60.0


def _parallel(*fns: Callable[[], Any]) -> list[Any]:
    """Run `fns` on threads at once (a rendezvous or a collective needs every rank); their
    results, or the first error raised."""
    results: list[Any] = [None] * len(fns)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a rank never finished"
    if errors:
        raise errors[0]
    return results


@pytest.mark.integration
@pytest.mark.parametrize("bucket_bytes", [64, 0], ids=["buckets", "per-tensor"])
def test_a_member_receives_the_trainers_bytes_through_the_relay(
    bucket_bytes: int, tmp_path: Path
) -> None:
    sent = sample_tensors()
    specs = tensor_specs(sent)
    port = free_port()
    store = host_store(port, TIMEOUT_S)
    out = tmp_path / "relay.safetensors"
    relay = subprocess.Popen(
        [sys.executable, "-m", "tests.common.weights.relay_worker", str(port)]
        + [str(bucket_bytes), "2", str(out)],
        cwd=ROOT,
    )
    try:
        at = {"master_address": "127.0.0.1", "master_port": port, "timeout_s": TIMEOUT_S}
        trainer, member = _parallel(
            lambda: WeightsGroup(rank=0, world_size=2, group_name="relay.top", store=store, **at),  # type: ignore[arg-type]
            lambda: WeightsGroup(rank=1, world_size=2, group_name="relay.node", **at),  # type: ignore[arg-type]
        )
        for _ in range(2):  # the groups serve a second update as they did the first
            _, got = _parallel(
                lambda: send_buckets(trainer, sent, bucket_bytes),
                lambda: recv_buckets(member, specs, bucket_bytes),
            )
            assert_bit_identical(sent, got)
        assert relay.wait(TIMEOUT_S) == 0
        assert_bit_identical(sent, load_file(str(out)))  # the relay's own copy too
        trainer.release()
        member.release()
    finally:
        if relay.poll() is None:
            relay.kill()


class _Upstream:
    """Stands in for the trainer's group: each broadcast fills the next bucket."""

    device = torch.device("cpu")

    def __init__(self, flats: list[torch.Tensor]) -> None:
        self.flats = iter(flats)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        tensor.copy_(next(self.flats))


class _DeadNode:
    """A node group whose member is gone: starting a broadcast fails."""

    def __init__(self) -> None:
        self.started = 0

    def broadcast_async(self, tensor: torch.Tensor, src: int = 0) -> Any:
        self.started += 1
        raise RuntimeError("connection reset by peer")


def test_a_relay_that_cannot_forward_keeps_receiving_and_keeps_its_copy() -> None:
    sent = sample_tensors()
    specs = tensor_specs(sent)
    flats = [flatten_bucket(b, sent) for b in make_buckets(specs, 16)]
    assert len(flats) > 2  # several buckets after the one that failed
    node = _DeadNode()
    relayed = relay_buckets(_Upstream(flats), node, specs, 16)  # type: ignore[arg-type]
    assert "connection reset" in str(relayed.forward_error)
    assert node.started == 1  # no further bucket is sent into a broken group
    assert_bit_identical(sent, relayed.tensors)
