"""A relay in its own process, for tests/common/weights/test_relay.py.

    python -m tests.common.weights.relay_worker PORT BUCKET_BYTES UPDATES OUT

Joins the trainer's group (`relay.top`, rank 1 of 2) and its node's group (`relay.node`,
rank 0 of 2, store hosted by the trainer), relays `UPDATES` updates of `sample_tensors()`
with `relay_buckets`, and writes what it received last to `OUT` (safetensors).
"""

from __future__ import annotations

import sys

from safetensors.torch import save_file

from services.common.weights.distributed import WeightsGroup, relay_buckets
from services.common.weights.manifest import tensor_specs
from tests.common.weights.samples import sample_tensors


def main(port: int, bucket_bytes: int, updates: int, out: str) -> None:
    at = {"master_address": "127.0.0.1", "master_port": port, "timeout_s": 60.0}
    top = WeightsGroup(rank=1, world_size=2, group_name="relay.top", **at)  # type: ignore[arg-type]
    node = WeightsGroup(rank=0, world_size=2, group_name="relay.node", remote_store=True, **at)  # type: ignore[arg-type]
    specs = tensor_specs(sample_tensors())
    for _ in range(updates):
        relayed = relay_buckets(top, node, specs, bucket_bytes)
        if relayed.forward_error is not None:
            raise SystemExit(f"forward failed: {relayed.forward_error}")
    save_file({k: t.contiguous() for k, t in relayed.tensors.items()}, out)
    node.release()
    top.release()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
