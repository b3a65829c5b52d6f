"""One rank of the SmolLM2 FSDP2 gradient job (started by `spawn_ranks`, like the service).

`python tests/trainer/smollm2_grad_job.py SPEC.json`: the spec names the converted model
directory, the run root and the batch (prompt and completion token ids, one advantage per
sequence). Every rank builds the trainer's actor engine (FSDP2 over the job's gloo group,
float32), takes its share of the batch from the trainer's own plan (`make_plan`), and runs
one forward/backward of a token-mean policy-gradient loss whose normaliser is the
batch-wide token count divided by the world size (FSDP averages gradients over ranks, as
`PPOTrainer._normalizer` does). Rank 0 writes the summed loss and the full gradients
(`DTensor.full_tensor()`) as safetensors. Ends through `finish` so the exit status is
truthful.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.common.config import MicroBatchSpec  # noqa: E402
from services.trainer.dist import finish, init_distributed  # noqa: E402
from services.trainer.engine import TrainEngine  # noqa: E402
from services.trainer.plan import make_plan, rank_microbatches  # noqa: E402
from tests.smollm2 import completion_batch  # noqa: E402
from tests.trainer.helpers import trainer_config  # noqa: E402


def main() -> int:
    torch.set_num_threads(1)
    spec = json.loads(Path(sys.argv[1]).read_text())
    cfg = trainer_config(Path(spec["model_dir"]), Path(spec["run_root"]), "actor.optimizer.lr=1e-5")
    ctx = init_distributed("cpu")
    engine = TrainEngine(cfg.actor, ctx, total_steps=1)
    batch = completion_batch(spec["prompts"], spec["outputs"])
    adv = torch.tensor(spec["advantages"], dtype=torch.float32)
    plan = make_plan(
        batch.seq_lens.tolist(),
        n_minibatches=1,
        world_size=ctx.world_size,
        mb_spec=MicroBatchSpec(n_mbs=2),
    )
    normalizer = float(batch.loss_mask.sum()) / ctx.world_size
    loss_sum = torch.zeros((), dtype=torch.float64)
    for _, rows in rank_microbatches(plan, ctx.rank):
        mb = batch.select(rows) if rows else None
        logp, _ = engine.logprobs(mb)
        if mb is None:  # joins the collectives, adds nothing
            (logp.sum() * 0.0).backward()
            continue
        loss = -(logp * mb.loss_mask * adv[rows].unsqueeze(1)).sum() / normalizer
        loss.backward()
        loss_sum += float(loss.detach())
    if ctx.world_size > 1:
        dist.all_reduce(loss_sum)
    grads = {}
    for name, p in engine.module.named_parameters():
        assert p.grad is not None, name
        g = p.grad
        grads[name] = g.full_tensor() if hasattr(g, "full_tensor") else g
    if ctx.rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in grads.items()}, spec["out"] + ".safetensors")
        result = {"loss": float(loss_sum) / ctx.world_size, "plan": plan}
        Path(spec["out"] + ".json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    finish(main())  # an exception exits non-zero with its traceback on its own
