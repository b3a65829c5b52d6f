"""Codec: round trips for any valid trajectory, and each malformed input refused with its reason."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flywheel_proto.v1 import common_pb2
from services.common.codec import (
    CodecError,
    CodecLimits,
    array_to_tensor,
    group_from_proto,
    group_to_proto,
    tensor_to_array,
    trajectory_from_proto,
    trajectory_to_proto,
)
from services.core.types import Trajectory, TrajectoryGroup


def make_traj(prompt_len=3, gen_len=4, version=2, tid="t0", gid="g0", turns=False) -> Trajectory:
    n = prompt_len + gen_len
    return Trajectory(
        trajectory_id=tid,
        group_id=gid,
        input_ids=np.arange(n),
        loss_mask=[0] * prompt_len + [1] * gen_len,
        logprobs=[0.0] * prompt_len + [-0.5] * gen_len,
        versions=[-1] * prompt_len + [version] * gen_len,
        reward=1.0,
        no_eos=False,
        prompt_len=prompt_len,
        turn_ids=([-1] * prompt_len + [0] * gen_len) if turns else None,
    )


@st.composite
def trajectories(draw):
    prompt_len = draw(st.integers(1, 20))
    gen_len = draw(st.integers(0, 30))
    n = prompt_len + gen_len
    gen_mask = draw(st.lists(st.integers(0, 1), min_size=gen_len, max_size=gen_len))
    mask = [0] * prompt_len + gen_mask
    versions = [-1] * prompt_len + [
        draw(st.integers(0, 1000)) if m else draw(st.integers(-1, 1000)) for m in gen_mask
    ]
    logprobs = [draw(st.floats(-50.0, 0.0, allow_nan=False, width=32)) if m else 0.0 for m in mask]
    turns = draw(st.booleans())
    return Trajectory(
        trajectory_id=draw(st.text(min_size=1, max_size=12)),
        group_id="g",
        input_ids=draw(st.lists(st.integers(0, 2**31), min_size=n, max_size=n)),
        loss_mask=mask,
        logprobs=logprobs,
        versions=versions,
        reward=draw(st.floats(-1e6, 1e6, allow_nan=False)),
        no_eos=draw(st.booleans()),
        prompt_len=prompt_len,
        stop_reason=draw(st.sampled_from(["stop", "length", "abort"])),
        turn_ids=[draw(st.integers(-1, 5)) for _ in range(n)] if turns else None,
        metadata=draw(st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3)),
    )


@settings(max_examples=200, deadline=None)
@given(trajectories())
def test_trajectory_round_trip(t: Trajectory):
    wire = trajectory_to_proto(t).SerializeToString()
    msg = common_pb2.Trajectory()
    msg.ParseFromString(wire)
    back = trajectory_from_proto(msg)
    for name in ("input_ids", "loss_mask", "logprobs", "versions"):
        np.testing.assert_array_equal(getattr(back, name), getattr(t, name))
    assert (back.turn_ids is None) == (t.turn_ids is None)
    if t.turn_ids is not None:
        np.testing.assert_array_equal(back.turn_ids, t.turn_ids)
    assert (back.reward, back.no_eos, back.prompt_len, back.stop_reason, back.metadata) == (
        t.reward,
        t.no_eos,
        t.prompt_len,
        t.stop_reason,
        t.metadata,
    )


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(-(2**40), 2**40), max_size=50), st.sampled_from(["int64", "float64"]))
def test_tensor_round_trip(values, dtype):
    arr = np.asarray(values, dtype=dtype)
    np.testing.assert_array_equal(tensor_to_array(array_to_tensor(arr)), arr)


def test_tensor_bytes_are_little_endian_packed():
    msg = array_to_tensor(np.asarray([1, 256], dtype=">i4"))
    assert msg.dtype == "int32" and list(msg.shape) == [2]
    assert msg.data == b"\x01\x00\x00\x00\x00\x01\x00\x00"


def test_group_round_trip_and_versions():
    g = TrajectoryGroup("g0", [make_traj(version=3), make_traj(version=5, tid="t1")], prompt_id="p")
    back = group_from_proto(group_to_proto(g))
    assert [t.trajectory_id for t in back.trajectories] == ["t0", "t1"]
    assert (back.oldest_version, back.newest_version, back.prompt_id) == (3, 5, "p")


def _proto(**changes) -> common_pb2.Trajectory:
    msg = trajectory_to_proto(make_traj(turns=True))
    for key, value in changes.items():
        if isinstance(value, np.ndarray):
            getattr(msg, key).CopyFrom(array_to_tensor(value))
        else:
            setattr(msg, key, value)
    return msg


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"trajectory_id": ""}, "trajectory_id is empty"),
        ({"logprobs": np.zeros(6, np.float32)}, "differ in length"),
        ({"turn_ids": np.zeros(5, np.int64)}, "differ in length"),
        ({"versions": np.asarray([-1, 0, -1, 1, 1, 1, 1])}, "-1 on the 3 prompt tokens"),
        ({"versions": np.asarray([-1, -1, -1, 1, -1, 1, 1])}, "need a version >= 0"),
        ({"loss_mask": np.asarray([0, 1, 0, 1, 1, 1, 1], np.int8)}, "loss_mask is 1 inside"),
        ({"loss_mask": np.asarray([0, 0, 0, 2, 1, 1, 1], np.int8)}, "only 0 and 1"),
        ({"logprobs": np.asarray([0, 0, 0, np.nan, -1, -1, -1], np.float32)}, "NaN or Inf"),
        ({"logprobs": np.asarray([0, 0, 0, 0.5, -1, -1, -1], np.float32)}, "must be <= 0"),
        ({"prompt_len": 0}, "prompt_len 0 outside"),
        ({"prompt_len": 99}, "prompt_len 99 outside"),
        ({"reward": float("inf")}, "reward is not finite"),
        ({"input_ids": np.asarray([0, 1, 2, -3, 4, 5, 6])}, "negative token id"),
        ({"input_ids": np.zeros((7, 1), np.int64)}, "must be 1-D"),
        ({"logprobs": np.zeros(7, np.int32)}, "must be a float tensor"),
    ],
)
def test_malformed_trajectories_are_rejected_with_reason(changes, reason):
    with pytest.raises(CodecError, match=reason):
        trajectory_from_proto(_proto(**changes))


def test_byte_length_mismatch_and_unknown_dtype_are_rejected():
    msg = _proto()
    msg.input_ids.data = msg.input_ids.data[:-1]
    with pytest.raises(CodecError, match="byte length 55 != prod"):
        trajectory_from_proto(msg)
    msg = _proto()
    msg.logprobs.dtype = "complex64"
    with pytest.raises(CodecError, match="unknown dtype 'complex64'"):
        trajectory_from_proto(msg)
    msg = _proto()
    msg.ClearField("versions")
    with pytest.raises(CodecError, match="versions is missing"):
        trajectory_from_proto(msg)


def test_size_limits_are_enforced_before_allocation():
    with pytest.raises(CodecError, match="exceeds the limit of 4"):
        trajectory_from_proto(_proto(), CodecLimits(max_tokens=4))
    huge = common_pb2.Tensor(dtype="int64", shape=[1 << 40], data=b"")
    with pytest.raises(CodecError, match="exceeds the limit"):
        tensor_to_array(huge)
    g = group_to_proto(TrajectoryGroup("g", [make_traj(tid=f"t{i}") for i in range(3)]))
    with pytest.raises(CodecError, match="has 3 trajectories \\(limit 2\\)"):
        group_from_proto(g, CodecLimits(max_trajectories=2))


def test_group_level_rejections():
    with pytest.raises(CodecError, match="group_id is empty"):
        group_from_proto(common_pb2.TrajectoryGroup())
    with pytest.raises(CodecError, match="has no trajectories"):
        group_from_proto(common_pb2.TrajectoryGroup(group_id="g"))
    dup = group_to_proto(TrajectoryGroup("g0", [make_traj(), make_traj()]))
    with pytest.raises(CodecError, match="repeats a trajectory_id"):
        group_from_proto(dup)
    other = group_to_proto(TrajectoryGroup("g1", [make_traj(gid="g0")]))
    with pytest.raises(CodecError, match="says group 'g0'"):
        group_from_proto(other)


# -- images: once per group, encoded bytes, bounded -----------------------------------------


def test_group_images_round_trip_byte_for_byte() -> None:
    from tests.image_samples import encoded

    images = [encoded(56, 56, "PNG"), encoded(31, 20, "JPEG")]
    g = TrajectoryGroup(group_id="g0", trajectories=[make_traj()], images=images)
    wire = group_to_proto(g).SerializeToString()
    back = group_from_proto(common_pb2.TrajectoryGroup.FromString(wire))
    assert back.images == images  # same bytes, same order
    text = group_from_proto(group_to_proto(TrajectoryGroup("g1", [make_traj(gid="g1")])))
    assert text.images == []


@pytest.mark.parametrize(
    ("images", "why"),
    [
        (lambda e: [b"not an image"], "image 0: not a PNG or JPEG"),
        (lambda e: [e(8, 8)] * 3, "3 images (limit 2 per group)"),
        (lambda e: [e(8, 8), e(8, 8) + b"\0" * 5000], "image 1 has"),
        (lambda e: [e(101, 100)], "image 0 is 101x100 = 10100 pixels"),
    ],
)
def test_bad_group_images_are_refused_naming_the_group_and_image(images, why) -> None:  # noqa: ANN001
    from services.common.image_bytes import ImageLimits
    from tests.image_samples import encoded

    limits = CodecLimits(images=ImageLimits(max_images=2, max_image_bytes=4096, max_pixels=10_000))
    msg = group_to_proto(TrajectoryGroup("g0", [make_traj()], images=images(encoded)))
    with pytest.raises(CodecError, match=re.escape(f"group 'g0': {why}")):
        group_from_proto(msg, limits)
