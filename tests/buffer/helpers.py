"""Small builders shared by the buffer tests: real groups, real buffers, real clients."""

from __future__ import annotations

import zlib

import numpy as np
import redis

from services.core.types import Trajectory, TrajectoryGroup


def make_group(
    group_id: str,
    *,
    version: int = 0,
    oldest: int | None = None,
    rewards: tuple[float, ...] = (0.0, 1.0),
    prompt_len: int = 3,
    gen_len: int = 4,
    reservation_id: str = "",
) -> TrajectoryGroup:
    """A valid group: one trajectory per reward; generated tokens carry `version`, except
    the first generated token of the first trajectory, which carries `oldest` if given."""
    trajectories = []
    n_tokens = prompt_len + gen_len
    for i, reward in enumerate(rewards):
        versions = np.array([-1] * prompt_len + [version] * gen_len, dtype=np.int64)
        if oldest is not None and i == 0:
            versions[prompt_len] = oldest
        rng = np.random.default_rng(zlib.crc32(f"{group_id}/{i}".encode()))
        trajectories.append(
            Trajectory(
                trajectory_id=f"{group_id}/{i}",
                group_id=group_id,
                input_ids=rng.integers(0, 1000, n_tokens),
                loss_mask=np.array([0] * prompt_len + [1] * gen_len, dtype=np.int8),
                logprobs=np.concatenate(
                    [np.zeros(prompt_len), -rng.random(gen_len).astype(np.float32)]
                ),
                versions=versions,
                reward=float(reward),
                no_eos=False,
                prompt_len=prompt_len,
                metadata={"i": str(i)},
            )
        )
    return TrajectoryGroup(
        group_id=group_id,
        trajectories=trajectories,
        prompt_id=f"p-{group_id}",
        reservation_id=reservation_id,
        rollout_id="r0",
        created_unix_ms=1,
    )


def assert_groups_equal(a: TrajectoryGroup, b: TrajectoryGroup) -> None:
    """Every token, mask, log-probability, version and reward equal, bit for bit."""
    assert a.group_id == b.group_id
    assert a.prompt_id == b.prompt_id
    assert len(a.trajectories) == len(b.trajectories)
    for x, y in zip(a.trajectories, b.trajectories, strict=True):
        assert x.trajectory_id == y.trajectory_id
        np.testing.assert_array_equal(x.input_ids, y.input_ids)
        np.testing.assert_array_equal(x.loss_mask, y.loss_mask)
        np.testing.assert_array_equal(x.logprobs, y.logprobs)  # exact: float32 round trip
        np.testing.assert_array_equal(x.versions, y.versions)
        assert x.reward == y.reward
        assert x.prompt_len == y.prompt_len
        assert x.metadata == y.metadata


def exploding_filter(group: TrajectoryGroup) -> bool:
    """A user filter with a bug (for the tests of how the buffer survives it)."""
    raise RuntimeError(f"boom on {group.group_id}")


def fsync_every_write(redis_url: str) -> None:
    """Switch a test's Redis to `appendfsync always` for the rest of its life.

    Tests that kill Redis to observe an *outage* must not also observe Redis's documented
    `everysec` exception (redis.conf: while a background fsync is slow, the AOF write may be
    postponed by up to 2 s, so a SIGKILL loses the last acknowledged writes). On a loaded
    machine that exception made a group put just before the kill vanish; what durability
    `everysec` gives is tested on its own in tests/common/test_redis_server.py.
    """
    client = redis.Redis.from_url(redis_url)
    try:
        client.config_set("appendfsync", "always")
    finally:
        client.close()
