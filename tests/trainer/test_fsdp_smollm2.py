"""FSDP2 over 2 gloo ranks gives the loss and gradients of 1 rank on SmolLM2-135M-Instruct.

The tiny-model version (`test_fsdp_equivalence.py`) checks whole PPO steps on 2 layers
and a 24-symbol vocabulary; this one checks the gradient itself on the real model: 30
layers, grouped-query attention, a 49,152-token vocabulary and tied input/output
embeddings (the tied matrix gets gradient from both the embedding lookup and the head, on
ranks that each hold half of it). Both runs are separate processes started like the
service's ranks (`spawn_ranks`, one thread each) running `smollm2_grad_job.py`.

Reference: the 1-rank run of the same code (a 1-rank FSDP2 mesh is a plain model with
the same arithmetic). Tolerance: float32; the 2-rank gradient is the average of two
half-batch gradients, the 1-rank one their sum in a different order (and the micro-batches
are padded differently), so each element agrees to summation-order rounding relative to
its tensor's scale: |difference| <= 1e-4 x max |gradient| of that tensor (measured: at
most 1.5e-5). A wrong normaliser, a missing rank's contribution or a tied matrix reduced
once instead of twice would be off by a large fraction of the scale. Runs in ~40 s on 2
quiet cores (three processes load the model).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from services.rollout.engine.torch_engine import load_tokenizer
from services.trainer.launch import spawn_ranks
from tests import smollm2

pytestmark = [pytest.mark.slow, pytest.mark.integration]

JOB = Path(__file__).with_name("smollm2_grad_job.py")
PAIRS = [(3, 4), (8, 7), (2, 9), (6, 5)]


def _run(world: int, tmp: Path, spec: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    out = tmp / f"w{world}"
    path = tmp / f"spec{world}.json"
    path.write_text(json.dumps({**spec, "run_root": str(tmp), "out": str(out)}))
    assert spawn_ranks([], world, command=[sys.executable, str(JOB), str(path)]) == 0
    return json.loads(out.with_suffix(".json").read_text()), load_file(str(out) + ".safetensors")


def test_two_ranks_give_the_loss_and_gradients_of_one(tmp_path: Path) -> None:
    model_dir = smollm2.model_dir()
    prompts = smollm2.chat_prompts(load_tokenizer(model_dir), PAIRS)
    g = torch.Generator().manual_seed(0)
    # Completions of different lengths (right padding differs between micro-batches) over
    # the whole vocabulary, advantages of both signs.
    outputs = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 9, 3, 7)]
    spec = {
        "model_dir": str(model_dir),
        "prompts": prompts,
        "outputs": outputs,
        "advantages": [1.0, -0.5, 0.75, -1.25],
    }
    one, g1 = _run(1, tmp_path, spec)
    two, g2 = _run(2, tmp_path, spec)
    # The 2-rank job really split the batch: each rank trained on its own sequences.
    rank_rows = [sorted(r for mb in per_rank for r in mb) for per_rank in two["plan"][0]]
    assert rank_rows[0] and rank_rows[1] and not set(rank_rows[0]) & set(rank_rows[1])
    torch.testing.assert_close(two["loss"], one["loss"], rtol=1e-5, atol=0)
    assert set(g1) == set(g2) and "model.embed_tokens.weight" in g1
    assert "lm_head.weight" not in g1  # tied: one tensor, its gradient from both uses
    worst = max(((g2[n] - g1[n]).abs().max() / g1[n].abs().max()).item() for n in g1)
    for name in g1:
        scale = float(g1[name].abs().max())
        torch.testing.assert_close(
            g2[name], g1[name], rtol=0, atol=1e-4 * scale, msg=lambda m, n=name: f"{n}: {m}"
        )
    print(f"worst |grad 2 ranks - grad 1 rank| / max |grad|: {worst:.1e}")
    # The gradient is not trivially zero anywhere that matters.
    assert float(g1["model.layers.0.self_attn.q_proj.weight"].abs().max()) > 1e-5
    assert float(g1["model.embed_tokens.weight"].abs().max()) > 1e-5
