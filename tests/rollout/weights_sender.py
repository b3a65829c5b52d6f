"""The trainer side of a distributed weight update, run as its own process by the tests.

`python -m tests.rollout.weights_sender MODEL_DIR PORT WORLD_SIZE BUCKETS...` joins the
weights group as rank 0 and broadcasts the model's parameters once per bucket size given
(0 = one broadcast per tensor), then closes the group.
"""

from __future__ import annotations

import sys

import torch

from services.common.weights.distributed import WeightsGroup, send_buckets
from services.common.weights.manifest import named_parameters_for_update


def main(argv: list[str]) -> int:
    from transformers import AutoModelForCausalLM

    model_dir, port, world_size, *buckets = argv
    torch.set_num_threads(1)
    sd = named_parameters_for_update(AutoModelForCausalLM.from_pretrained(model_dir))
    group = WeightsGroup(
        master_address="127.0.0.1",
        master_port=int(port),
        rank=0,
        world_size=int(world_size),
        backend="gloo",
        timeout_s=120,
    )
    for b in buckets:
        send_buckets(group, sd, int(b))
    group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
