"""The run the Kubernetes launcher's tests deploy: release `demo` in namespace `fw-test`,
2 rollout replicas, 2 trainer ranks, model and data on the shared volume."""

from __future__ import annotations

from pathlib import Path

from services.common.config import FlywheelConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = [
    "scheduler.type=kubernetes",
    "scheduler.namespace=fw-test",
    "scheduler.release_name=demo",
    "scheduler.image=ghcr.io/flywheel-rl/flywheel-cpu:0.1.0",
    "actor.path=/data/shared/models/tiny",
    "train_dataset.path=/data/shared/data/train.jsonl",
    "rollout.n_replicas=2",
    "trainer.n_ranks=2",
    "launcher.startup_timeout=30",
]


def load(*extra: str) -> FlywheelConfig:
    """examples/grpo.yaml with OVERRIDES, then `extra`."""
    return load_config(str(ROOT / "examples" / "grpo.yaml"), [*OVERRIDES, *extra])
