"""The fast admission check (services/buffer/validate.py) never accepts what the codec rejects,
and agrees with it on the versions of what both accept."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flywheel_proto.v1 import common_pb2
from services.buffer.validate import fast_versions
from services.common.codec import (
    CodecError,
    CodecLimits,
    array_to_tensor,
    group_from_proto,
    group_to_proto,
)

from .helpers import make_group

Msg = common_pb2.TrajectoryGroup


def codec_verdict(msg: Msg, limits: CodecLimits = CodecLimits()) -> tuple[int, int] | None:
    try:
        g = group_from_proto(msg, limits)
    except CodecError:
        return None
    return g.oldest_version, g.newest_version


def base() -> Msg:
    return group_to_proto(make_group("g", version=4, oldest=2, rewards=(0.0, 1.0, 0.5)))


def set_tensor(t: common_pb2.Trajectory, field: str, arr: np.ndarray) -> None:
    getattr(t, field).CopyFrom(array_to_tensor(arr))


def arr(t: common_pb2.Trajectory, field: str) -> np.ndarray:
    from services.common.codec import tensor_to_array

    return tensor_to_array(getattr(t, field)).copy()


def poke(field: str, index: int, value: float) -> Callable[[Msg], None]:
    def mutate(m: Msg) -> None:
        t = m.trajectories[1]
        a = arr(t, field)
        a[index] = value
        set_tensor(t, field, a)

    return mutate


MUTATIONS: dict[str, Callable[[Msg], None]] = {
    "empty group id": lambda m: setattr(m, "group_id", ""),
    "no trajectories": lambda m: m.ClearField("trajectories"),
    "empty trajectory id": lambda m: setattr(m.trajectories[0], "trajectory_id", ""),
    "repeated trajectory id": lambda m: setattr(m.trajectories[1], "trajectory_id", "g/0"),
    "foreign group id": lambda m: setattr(m.trajectories[2], "group_id", "other"),
    "missing tensor": lambda m: m.trajectories[0].ClearField("logprobs"),
    "unknown dtype": lambda m: setattr(m.trajectories[0].versions, "dtype", "int128"),
    "2-D tensor": lambda m: m.trajectories[0].loss_mask.shape.append(1),
    "short bytes": lambda m: setattr(
        m.trajectories[0].input_ids, "data", m.trajectories[0].input_ids.data[:-1]
    ),
    "lengths differ": lambda m: set_tensor(
        m.trajectories[0], "versions", np.array([-1, -1, -1, 4])
    ),
    "prompt_len 0": lambda m: setattr(m.trajectories[0], "prompt_len", 0),
    "prompt_len too long": lambda m: setattr(m.trajectories[0], "prompt_len", 99),
    "mask value 2": poke("loss_mask", 5, 2),
    "mask value -1": poke("loss_mask", 5, -1),
    "mask 1 in prompt": poke("loss_mask", 1, 1),
    "version in prompt": poke("versions", 0, 3),
    "generated version -1": poke("versions", 4, -1),
    "nan logprob": poke("logprobs", 4, np.nan),
    "-inf logprob": poke("logprobs", 4, -np.inf),
    "positive logprob": poke("logprobs", 4, 0.5),
    "negative token id": poke("input_ids", 2, -7),
    "infinite reward": lambda m: setattr(m.trajectories[0], "reward", float("inf")),
    "huge metadata": lambda m: m.trajectories[0].metadata.update({"k": "x" * (70 << 10)}),
    "float loss mask": lambda m: set_tensor(
        m.trajectories[0], "loss_mask", arr(m.trajectories[0], "loss_mask").astype(np.float32)
    ),
    "float64 logprobs": lambda m: set_tensor(
        m.trajectories[0], "logprobs", arr(m.trajectories[0], "logprobs").astype(np.float64)
    ),
    "int32 ids": lambda m: set_tensor(
        m.trajectories[0], "input_ids", arr(m.trajectories[0], "input_ids").astype(np.int32)
    ),
    "multi-turn": lambda m: set_tensor(m.trajectories[0], "turn_ids", np.array([-1] * 3 + [0] * 4)),
    "no generated tokens": lambda m: [
        set_tensor(t, "loss_mask", np.zeros(7, np.int8)) for t in m.trajectories
    ],
}


def test_agrees_with_the_codec_on_a_valid_group() -> None:
    m = base()
    assert fast_versions(m) == codec_verdict(m) == (2, 4)


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_never_accepts_what_the_codec_rejects(name: str) -> None:
    m = base()
    MUTATIONS[name](m)
    fast, codec = fast_versions(m), codec_verdict(m)
    if codec is None:
        assert fast is None
    else:  # valid, maybe outside the fast path's common case: then it defers
        assert fast in (None, codec)


@pytest.mark.parametrize(
    ("limits", "why"),
    [
        (CodecLimits(max_trajectories=2), "3 trajectories > 2"),
        (CodecLimits(max_tokens=6), "7 tokens > 6"),
    ],
)
def test_respects_the_codec_limits(limits: CodecLimits, why: str) -> None:
    m = base()
    assert codec_verdict(m, limits) is None, why
    assert fast_versions(m, limits) is None


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 6)), min_size=1, max_size=4),
    versions=st.lists(st.integers(0, 9), min_size=1, max_size=24),
    corrupt=st.one_of(
        st.none(),
        st.tuples(
            st.sampled_from(["loss_mask", "versions"]), st.integers(0, 50), st.integers(-2, 3)
        ),
    ),
)
def test_random_groups_match_the_codec(lens, versions, corrupt) -> None:  # noqa: ANN001
    msg = Msg(group_id="h")
    k = 0
    for i, (p, g) in enumerate(lens):
        n = p + g
        vs = np.array([-1] * p + [versions[(k + j) % len(versions)] for j in range(g)])
        k += g
        mask = np.array([0] * p + [1] * g, dtype=np.int8)
        t = msg.trajectories.add(trajectory_id=f"t{i}", prompt_len=p, reward=float(i))
        set_tensor(t, "input_ids", np.arange(n, dtype=np.int64))
        set_tensor(t, "loss_mask", mask)
        set_tensor(t, "logprobs", np.where(mask == 1, -0.5, 0.0).astype(np.float32))
        set_tensor(t, "versions", vs.astype(np.int64))
    if corrupt is not None:
        field, pos, value = corrupt
        t = msg.trajectories[pos % len(msg.trajectories)]
        a = arr(t, field)
        a[pos % a.size] = value
        set_tensor(t, field, a)
    fast, codec = fast_versions(msg), codec_verdict(msg)
    if codec is None:
        assert fast is None
    else:
        assert fast == codec  # common-case dtypes only here: the fast path must decide
