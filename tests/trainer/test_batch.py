"""Groups become right-padded tensors with the wire's per-token conventions."""

from __future__ import annotations

import numpy as np
import torch

from services.core.types import Trajectory, TrajectoryGroup
from services.trainer.batch import from_groups


def _traj(tid: str, gid: str, ids: list[int], prompt_len: int, reward: float) -> Trajectory:
    n = len(ids)
    mask = np.array([0] * prompt_len + [1] * (n - prompt_len), dtype=np.int8)
    return Trajectory(
        trajectory_id=tid,
        group_id=gid,
        input_ids=np.array(ids),
        loss_mask=mask,
        logprobs=np.where(mask == 1, -0.5, 0.0),
        versions=np.where(mask == 1, 3, -1),
        reward=reward,
        no_eos=False,
        prompt_len=prompt_len,
    )


def test_padding_and_group_index() -> None:
    groups = [
        TrajectoryGroup(
            "a", [_traj("a0", "a", [4, 5, 6], 2, 1.0), _traj("a1", "a", [4, 5], 1, 0.0)]
        ),
        TrajectoryGroup("b", [_traj("b0", "b", [7, 8, 9, 10], 2, 0.5)]),
    ]
    b = from_groups(groups)
    assert b.input_ids.tolist() == [[4, 5, 6, 0], [4, 5, 0, 0], [7, 8, 9, 10]]
    assert b.loss_mask.tolist() == [[0, 0, 1, 0], [0, 1, 0, 0], [0, 0, 1, 1]]
    assert b.versions.tolist() == [[-1, -1, 3, -1], [-1, 3, -1, -1], [-1, -1, 3, 3]]
    assert b.group_index.tolist() == [0, 0, 1]
    assert b.seq_lens.tolist() == [3, 2, 4]
    assert b.n_tokens == 9
    torch.testing.assert_close(b.rewards, torch.tensor([1.0, 0.0, 0.5]), rtol=0, atol=0)
    sub = b.select([1])
    assert sub.input_ids.tolist() == [[4, 5]]  # trimmed to its own length
    assert sub.attention_mask.tolist() == [[True, True]]
