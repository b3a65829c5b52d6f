"""DAPO dynamic sampling in the trainer loop: groups without signal leave the step's batch."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from services.common.config import load_config
from services.core.types import Trajectory, TrajectoryGroup
from services.trainer.loop import TrainerLoop


def group(gid: str, rewards: list[float]) -> TrajectoryGroup:
    trajs = [
        Trajectory(
            f"{gid}-{i}",
            gid,
            np.arange(4),
            [0, 0, 1, 1],
            [0, 0, -0.5, -0.5],
            [-1, -1, 0, 0],
            r,
            False,
            2,
        )
        for i, r in enumerate(rewards)
    ]
    return TrajectoryGroup(gid, trajs)


def test_equal_reward_groups_are_dropped_only_when_dynamic_sampling_is_on():
    groups = [
        group("mixed", [1.0, 0.0]),
        group("all-right", [1.0, 1.0]),
        group("all-wrong", [0.0, 0.0]),
    ]
    on = load_config("examples/grpo.yaml", ["actor.dynamic_sampling=true"])
    kept = TrainerLoop._dynamic_filter(SimpleNamespace(cfg=on), groups)  # type: ignore[arg-type]
    assert [g.group_id for g in kept] == ["mixed"]
    off = load_config("examples/grpo.yaml", ["actor.dynamic_sampling=false"])
    kept = TrainerLoop._dynamic_filter(SimpleNamespace(cfg=off), groups)  # type: ignore[arg-type]
    assert [g.group_id for g in kept] == ["mixed", "all-right", "all-wrong"]
