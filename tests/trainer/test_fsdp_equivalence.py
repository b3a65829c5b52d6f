"""FSDP2 over 2 ranks (real gloo process group) equals 1 rank on the same batches."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flywheel_proto.v1 import buffer_pb2
from services.common.codec import group_from_proto, group_to_proto
from services.trainer.launch import spawn_ranks
from services.trainer.ppo import PPOTrainer
from tests.trainer.helpers import synthetic_groups, trainer_config

JOB = Path(__file__).with_name("rank_job.py")


def _run(world: int, tmp: Path, model: Path, batches: list[Path], device: str, *overrides: str):
    out = tmp / f"w{world}-{device}"
    spec = {
        "model_dir": str(model),
        "run_root": str(tmp),
        "overrides": list(overrides),
        "batches": [str(b) for b in batches],
        "out": str(out),
        "device": device,
    }
    spec_path = tmp / f"spec{world}-{device}.json"
    spec_path.write_text(json.dumps(spec))
    code = spawn_ranks([], world, command=[sys.executable, str(JOB), str(spec_path)])
    assert code == 0
    return json.loads(out.with_suffix(".json").read_text()), load_file(str(out) + ".safetensors")


def _batches(tmp: Path, model: Path) -> list[Path]:
    paths = []
    # The third batch has 2 sequences: with 2 minibatches each rank-share of a minibatch
    # holds 1 or 0 sequences, so one rank runs an empty (dummy) micro-batch.
    for seed, n_groups, size in ((0, 3, 4), (1, 3, 4), (2, 1, 2)):
        groups = synthetic_groups(model, n_groups=n_groups, group_size=size, seed=seed)
        p = tmp / f"batch{seed}.pb"
        p.write_bytes(
            buffer_pb2.ClaimResponse(groups=[group_to_proto(g) for g in groups]).SerializeToString()
        )
        paths.append(p)
    return paths


def _check(one, two) -> None:
    (res1, w1), (res2, w2) = one, two
    for a, b in zip(res1, res2, strict=True):
        # Same global batch, same normaliser: the losses differ only by summation order.
        torch.testing.assert_close(a["loss"], b["loss"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a["grad_norm"], b["grad_norm"], rtol=1e-4, atol=1e-6)
        assert a["stats"]["n_valid_tokens"] == b["stats"]["n_valid_tokens"]
        torch.testing.assert_close(
            a["stats"]["importance_weight/avg"],
            b["stats"]["importance_weight/avg"],
            rtol=1e-5,
            atol=1e-6,
        )
    assert set(w1) == set(w2)
    # Two AdamW steps at lr 1e-2 move weights by ~2e-2; summation-order noise in the
    # gradients moves near-zero-gradient elements by a small fraction of that.
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], rtol=0, atol=2e-4)


def _in_process(tmp: Path, model: Path, batches: list[Path], *overrides: str):
    """The same batches through a one-rank trainer in this process (same code path)."""
    trainer = PPOTrainer(trainer_config(model, tmp, *overrides))
    results = []
    for path in batches:
        msg = buffer_pb2.ClaimResponse.FromString(path.read_bytes())
        r = trainer.train_batch([group_from_proto(g) for g in msg.groups])
        results.append({"loss": r.loss, "stats": r.stats, "grad_norm": r.grad_norm})
    return results, trainer.actor.full_state_dict()


@pytest.mark.integration
def test_two_ranks_equal_one_rank(tiny_model_dir: Path, tmp_path: Path) -> None:
    batches = _batches(tmp_path, tiny_model_dir)
    overrides = ("actor.ppo_n_minibatches=2", "actor.mb_spec.max_tokens_per_mb=40")
    two = _run(2, tmp_path, tiny_model_dir, batches, "cpu", *overrides)
    one = _in_process(tmp_path, tiny_model_dir, batches, *overrides)
    _check(one, two)
    # The update did move the weights (the comparison is not between two untouched models).
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert (one[1][name] - initial[name]).abs().max() > 1e-3


@pytest.mark.gpu
@pytest.mark.integration
def test_two_ranks_equal_one_rank_on_cuda_nccl(tiny_model_dir: Path, tmp_path: Path) -> None:
    if torch.cuda.device_count() < 1:
        pytest.skip("needs a CUDA GPU")
    batches = _batches(tmp_path, tiny_model_dir)
    world = min(2, torch.cuda.device_count())
    one = _run(1, tmp_path, tiny_model_dir, batches, "cuda", "trainer.backend=nccl")
    two = _run(world, tmp_path, tiny_model_dir, batches, "cuda", "trainer.backend=nccl")
    _check(one, two)
