"""One rank of the gloo normalisation test (run as a script, not imported by pytest).

Both ranks rebuild the same seeded batch, normalise their half with the process group,
and print their result as JSON on stdout: nothing is pickled between processes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from services.trainer.algorithms.normalization import normalize  # noqa: E402


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 5, generator=g) * 3 + 1
    mask = torch.rand(6, 5, generator=g) < 0.7
    return x, mask


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        x, mask = batch()
        rows = slice(rank * 3, (rank + 1) * 3)
        out = normalize(
            x[rows],
            mask[rows],
            mean_level="batch",
            std_level="batch",
            process_group=dist.group.WORLD,
        )
        print(json.dumps(out.tolist()))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
