"""One rank of a multi-rank trainer test job (started by `spawn_ranks`, like the service).

Reads a JSON spec: the tiny model, config overrides and batch files (serialized
`ClaimResponse` protobufs: the same bytes a buffer claim carries). Runs one
`PPOTrainer.train_batch` per batch; rank 0 writes the step results as JSON and the final
full state dict as safetensors. Ends through `finish` so the exit status is truthful.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flywheel_proto.v1 import buffer_pb2  # noqa: E402
from services.common.codec import group_from_proto  # noqa: E402
from services.trainer.dist import finish, init_distributed  # noqa: E402
from services.trainer.ppo import PPOTrainer  # noqa: E402
from tests.trainer.helpers import trainer_config  # noqa: E402


def main() -> int:
    torch.set_num_threads(1)
    spec = json.loads(Path(sys.argv[1]).read_text())
    cfg = trainer_config(Path(spec["model_dir"]), Path(spec["run_root"]), *spec["overrides"])
    ctx = init_distributed(spec.get("device", "cpu"))
    trainer = PPOTrainer(cfg, ctx)
    results = []
    for path in spec["batches"]:
        msg = buffer_pb2.ClaimResponse.FromString(Path(path).read_bytes())
        groups = [group_from_proto(g) for g in msg.groups]
        r = trainer.train_batch(groups)
        results.append(
            {"loss": r.loss, "stats": r.stats, "grad_norm": r.grad_norm, "n_seqs": r.n_seqs}
        )
    sd = trainer.actor.full_state_dict()
    if ctx.rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in sd.items()}, spec["out"] + ".safetensors")
        Path(spec["out"] + ".json").write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    code = 1
    try:
        code = main()
    except Exception:  # noqa: BLE001 - report and exit non-zero through finish()
        traceback.print_exc()
    finish(code)
