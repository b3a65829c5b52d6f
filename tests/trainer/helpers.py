"""Shared helpers of the trainer tests: a config for the tiny model and synthetic groups.

Synthetic groups are real trajectories of the tiny model's vocabulary whose behaviour
log-probabilities come from the tiny model itself (a plain, unsharded HF forward), so the
trainer sees what a rollout engine holding the same weights would have produced.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from services.common.config import FlywheelConfig
from services.common.config.loader import load_config
from services.core.types import Trajectory, TrajectoryGroup


def trainer_config(model_dir: Path, run_root: Path, *overrides: str) -> FlywheelConfig:
    """A float32 GRPO-style config on the tiny model; `overrides` are dotted assignments."""
    base = [
        f"actor.path={model_dir}",
        "actor.dtype=float32",
        "actor.kl_ctl=0",
        "actor.optimizer.lr=1e-2",
        "actor.optimizer.warmup_steps=0",
        "actor.optimizer.weight_decay=0",
        "actor.ppo_n_minibatches=1",
        "actor.adv_norm.mean_level=group",
        "actor.adv_norm.std_level=group",
        "trainer.device=cpu",
        "trainer.export_hf=false",
        f"cluster.fileroot={run_root}",
        "experiment_name=t",
        "trial_name=t",
        "total_train_steps=100",
        "services.auth_token=null",
    ]
    return load_config(None, [*base, *overrides])


def behaviour_logprobs(model_dir: Path, seqs: Sequence[np.ndarray], temperature: float = 1.0):
    """log p(token t | tokens < t) under the unsharded HF model, per sequence (0 at t=0)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.as_tensor(s, dtype=torch.long).unsqueeze(0)
            logits = model(input_ids=ids).logits[0, :-1].float() / temperature
            lp = torch.log_softmax(logits, -1).gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1)
            out.append(np.concatenate([[0.0], lp.numpy()]).astype(np.float32))
    return out


def synthetic_groups(
    model_dir: Path,
    *,
    n_groups: int,
    group_size: int = 4,
    seed: int = 0,
    version: int = 0,
    prefix: str = "g",
) -> list[TrajectoryGroup]:
    """Groups of random prompts/completions over ids 3..23 with model logprobs and mixed
    0/1 rewards (each group has both, so group-normalised advantages are non-zero)."""
    rng = np.random.default_rng(seed)
    specs = []
    for g in range(n_groups):
        prompt = rng.integers(3, 24, size=int(rng.integers(3, 7)))
        for k in range(group_size):
            completion = rng.integers(3, 24, size=int(rng.integers(2, 9)))
            specs.append((g, k, prompt, completion))
    seqs = [np.concatenate([p, c]) for _, _, p, c in specs]
    logps = behaviour_logprobs(model_dir, seqs)
    groups: dict[int, list[Trajectory]] = {}
    for (g, k, prompt, _completion), seq, lp in zip(specs, seqs, logps, strict=True):
        n_p = len(prompt)
        mask = np.zeros(len(seq), dtype=np.int8)
        mask[n_p:] = 1
        versions = np.full(len(seq), -1, dtype=np.int64)
        versions[n_p:] = version
        groups.setdefault(g, []).append(
            Trajectory(
                trajectory_id=f"{prefix}{seed}-{g}-{k}",
                group_id=f"{prefix}{seed}-{g}",
                input_ids=seq,
                loss_mask=mask,
                logprobs=np.where(mask == 1, lp, 0.0),
                versions=versions,
                reward=float(k % 2),
                no_eos=bool(k == 3),
                prompt_len=n_p,
            )
        )
    return [
        TrajectoryGroup(group_id=f"{prefix}{seed}-{g}", trajectories=t) for g, t in groups.items()
    ]
