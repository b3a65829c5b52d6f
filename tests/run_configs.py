"""The smallest real `flywheel run` the end-to-end and deploy tests start as a user would.

One place for it, so that a config change (a renamed field, a new required one) is made once
and both kinds of tests keep running the same topology."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def tiny_run_config(fileroot: Path, *, experiment: str, steps: int) -> dict[str, Any]:
    """A run that reaches its first training step within seconds on two cores: a one-layer
    hidden-32 model without warm start or evaluation, groups of 4, one group per step.
    Callers add what their test needs (warm start, held-out data, checkpoints)."""
    return {
        "experiment_name": experiment,
        "trial_name": "t",
        "seed": 3,
        "total_train_steps": steps,
        "cluster": {"fileroot": str(fileroot)},
        "launcher": {
            "tiny_model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2},
            "warm_start": {"enabled": False},
            "eval": {"freq_steps": 0},
            "progress": False,
        },
        "train_dataset": {"builtin": "arithmetic", "builtin_size": 200},
        "gconfig": {"n_samples": 4, "max_new_tokens": 8, "temperature": 1.0},
        "rollout": {
            "consumer_batch_size": 4,
            "max_head_offpolicyness": 1,
            "max_concurrent_rollouts": 8,
        },
        "reward": {"fn": "gsm8k", "num_workers": 1},
        "actor": {
            "group_size": 4,
            "ppo_n_minibatches": 1,
            "kl_ctl": 0.0,
            "dtype": "float32",
            "use_decoupled_loss": True,
            "recompute_logprob": True,
            "adv_norm": {"mean_level": "group", "std_level": "group", "group_size": 4},
            "optimizer": {"lr": 1e-4, "warmup_steps": 1},
        },
        "trainer": {"n_ranks": 1, "weight_transport": "disk"},
    }
