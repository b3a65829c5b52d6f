"""The trainer side of a `distributed` weight update on SmolLM2, run as its own process.

`python tests/rollout/engine/smollm2_trainer_sender.py SPEC.json`: builds the trainer's
actor engine on the converted model (FSDP2 over a 1-rank gloo group, float32, AdamW at
lr 1e-5), takes one optimizer step on the spec's prompt + completion batch, gathers the
full state dict (tied embeddings once), writes the manifest and tensor specs of version 1
to `<out>/manifest.json`, then joins the weights group as rank 0 (a group of its own
beside the trainer's default one, as in the service), broadcasts the weights in buckets of
`bucket_bytes` and closes the group. A separate process because a process holds one
default group and the replica's side of the broadcast is another member.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from services.common.weights.distributed import WeightsGroup, send_buckets  # noqa: E402
from services.common.weights.manifest import make_manifest, tensor_specs  # noqa: E402
from services.trainer.dist import finish, init_distributed  # noqa: E402
from services.trainer.engine import TrainEngine  # noqa: E402
from tests.smollm2 import completion_batch  # noqa: E402
from tests.trainer.helpers import trainer_config  # noqa: E402


def main() -> int:
    torch.set_num_threads(1)
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    cfg = trainer_config(
        Path(spec["model_dir"]),
        out / "run",
        "actor.optimizer.lr=1e-5",
        "actor.optimizer.gradient_clipping=1.0",
    )
    ctx = init_distributed("cpu")
    trainer = TrainEngine(cfg.actor, ctx, total_steps=10)
    batch = completion_batch(spec["prompts"], spec["outputs"])
    logp, _ = trainer.logprobs(batch)
    (-(logp * batch.loss_mask).sum() / batch.loss_mask.sum()).backward()
    _, stepped = trainer.clip_and_step()
    assert stepped
    sd = trainer.full_state_dict()
    manifest = make_manifest(sd, 1)
    tmp = out / "manifest.json.tmp"
    tmp.write_text(
        json.dumps(
            {
                "manifest": manifest.to_json(),
                "specs": [[s.name, s.dtype, list(s.shape)] for s in tensor_specs(sd)],
                "bucket_bytes": spec["bucket_bytes"],
            }
        )
    )
    tmp.rename(out / "manifest.json")  # whole or absent for the reader
    group = WeightsGroup(
        master_address="127.0.0.1",
        master_port=int(spec["port"]),
        rank=0,
        world_size=2,
        backend="gloo",
        timeout_s=600,
    )
    send_buckets(group, sd, int(spec["bucket_bytes"]))
    group.close()
    return 0


if __name__ == "__main__":
    finish(main())  # an exception exits non-zero with its traceback on its own
