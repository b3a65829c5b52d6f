"""The fan-out benchmark's update plan, and short runs over real gloo groups (one group,
and the two-level fan-out)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.weights.distributed import make_buckets
from services.common.weights.manifest import tensor_specs

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from weight_fanout import node_layout, update_tensors  # noqa: E402


def test_an_update_packs_into_whole_buckets_of_the_transport() -> None:
    # 8 MiB in 2 MiB buckets: 4 buckets of 4 bf16 tensors of 2 MiB / 4 / 2 B = 262,144 values
    tensors = update_tensors(2 << 20, 8 << 20, seed=1)
    buckets = make_buckets(tensor_specs(tensors), 2 << 20)
    assert [b.nbytes for b in buckets] == [2 << 20] * 4
    assert all(len(b.specs) == 4 for b in buckets)
    again = update_tensors(2 << 20, 8 << 20, seed=1)  # the receiver draws the same bytes
    assert all(t.equal(again[k]) for k, t in tensors.items())


@pytest.mark.integration
def test_two_receivers_get_every_byte() -> None:
    cmd = [sys.executable, "benchmarks/weight_fanout.py", "--receivers", "2"]
    cmd += ["--bucket-mib", "1", "--update-mib", "2", "--repeats", "1"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180, check=True)
    (line,) = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    assert line["bit_identical"] is True
    assert line["receivers"] == 2 and line["buckets_per_update"] == 2
    assert line["update_bytes"] == 2 << 20


def test_receivers_form_nodes_whose_first_is_the_relay() -> None:
    assert node_layout(4, 2) == [[1, 2], [3, 4]]
    assert node_layout(3, 2) == [[1, 2], [3]]  # the last node has its relay alone
    assert node_layout(2, 4) == [[1, 2]]


@pytest.mark.integration
def test_two_level_receivers_get_every_byte() -> None:
    # Nodes [1, 2] and [3]: one relay forwards to a member, the other has no one to forward to.
    cmd = [sys.executable, "benchmarks/weight_fanout.py", "--fanout", "two_level"]
    cmd += ["--receivers", "3", "--bucket-mib", "1", "--update-mib", "2", "--repeats", "1"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180, check=True)
    (line,) = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    assert line["bit_identical"] is True
    assert line["fanout"] == "two_level" and line["nodes"] == 2 and line["receivers"] == 3
    assert line["buckets_per_update"] == 2 and line["update_bytes"] == 2 << 20
