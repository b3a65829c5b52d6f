"""Admission check of a put group, fast: the codec's rules, vectorised over the whole group.

Why this exists: `codec.group_from_proto` checks each trajectory with a dozen numpy calls
and copies every tensor, about 1 ms for 8 x 1,024 tokens, the single largest cost of a Put.
The buffer does not need the decoded arrays, only the verdict and the oldest/newest
generated version, so it checks the common case (int ids, int8/uint8 mask, float32
log-probabilities, single turn, one dtype per field across the group) with one numpy pass
per rule over all trajectories at once (~75 us instead of ~1 ms).

The codec stays the authority: this check only ever answers "certainly valid" (and then the
codec would accept the group too) or "not sure". On "not sure" the caller runs the codec,
which either names the exact violation or accepts a group outside the common case. The
equivalence is tested against the codec on valid groups and on one mutation per rule.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from flywheel_proto.v1 import common_pb2
from services.common.codec import CodecLimits
from services.common.image_bytes import images_problem
from services.common.limits import MAX_ID_BYTES

_INT: dict[str, np.dtype[Any]] = {"int32": np.dtype("<i4"), "int64": np.dtype("<i8")}
_MASK: dict[str, np.dtype[Any]] = {"int8": np.dtype("<i1"), "uint8": np.dtype("<u1")}
_PROMPT_THEN_COMPLETION = np.array([True, False])


def fast_versions(
    msg: common_pb2.TrajectoryGroup, limits: CodecLimits = CodecLimits()
) -> tuple[int, int] | None:
    """(oldest, newest) generated version (-1, -1 when none) if `msg` certainly passes
    `codec.group_from_proto`; None when the codec has to decide."""
    trajs = msg.trajectories
    gid = msg.group_id
    if not gid or not 0 < len(trajs) <= limits.max_trajectories:
        return None
    if msg.images and images_problem(msg.images, limits.images) is not None:
        return None  # the codec names the image that breaks a bound
    first = trajs[0]
    id_dt, mask_dt = first.input_ids.dtype, first.loss_mask.dtype
    lp_dt, ver_dt = first.logprobs.dtype, first.versions.dtype
    if id_dt not in _INT or ver_dt not in _INT or mask_dt not in _MASK or lp_dt != "float32":
        return None
    id_size, ver_size = _INT[id_dt].itemsize, _INT[ver_dt].itemsize
    max_tokens, max_meta = limits.max_tokens, limits.max_metadata_bytes
    seen: set[str] = set()
    runs: list[int] = []  # prompt length, completion length, per trajectory
    id_chunks: list[bytes] = []
    mask_chunks: list[bytes] = []
    lp_chunks: list[bytes] = []
    ver_chunks: list[bytes] = []
    for t in trajs:
        tid = t.trajectory_id
        if not tid or tid in seen or t.group_id not in ("", gid) or t.HasField("turn_ids"):
            return None
        seen.add(tid)
        # Spelled out, not looped over fields: this loop is most of the check's cost.
        a, m, lp, v = t.input_ids, t.loss_mask, t.logprobs, t.versions
        # One dtype per field across the group; a missing tensor has dtype "" and fails here.
        if a.dtype != id_dt or m.dtype != mask_dt or lp.dtype != lp_dt or v.dtype != ver_dt:
            return None
        sa, sm, sl, sv = a.shape, m.shape, lp.shape, v.shape
        if len(sa) != 1 or len(sm) != 1 or len(sl) != 1 or len(sv) != 1:
            return None
        n, p = sa[0], t.prompt_len
        if sm[0] != n or sl[0] != n or sv[0] != n or not 0 < p <= n <= max_tokens:
            return None
        da, dm, dl, dv = a.data, m.data, lp.data, v.data
        if len(da) != n * id_size or len(dm) != n or len(dl) != 4 * n or len(dv) != n * ver_size:
            return None
        if not math.isfinite(t.reward):
            return None
        if t.metadata and sum(len(k) + len(x) for k, x in t.metadata.items()) > max_meta:
            return None
        id_chunks.append(da)
        mask_chunks.append(dm)
        lp_chunks.append(dl)
        ver_chunks.append(dv)
        runs += (p, n - p)
    mask = np.frombuffer(b"".join(mask_chunks), np.uint8)  # -1 as uint8 is 255: caught here
    if mask.max() > 1:
        return None
    gen = mask.view(bool)
    prompt = np.repeat(np.tile(_PROMPT_THEN_COMPLETION, len(trajs)), runs)
    if (gen & prompt).any():
        return None
    lp = np.frombuffer(b"".join(lp_chunks), "<f4")
    if not (lp.max() <= 1e-4 and lp.min() > -np.inf):  # NaN fails both comparisons
        return None
    if np.frombuffer(b"".join(id_chunks), _INT[id_dt]).min() < 0:
        return None
    ver = np.frombuffer(b"".join(ver_chunks), _INT[ver_dt])
    if (ver[prompt] != -1).any():
        return None
    generated = ver[gen]
    if generated.size == 0:
        return -1, -1
    oldest = int(generated.min())
    if oldest < 0:
        return None
    return oldest, int(generated.max())


# -- bounds on ids and versions (MAX_ID_BYTES: services/common/limits.py) -------------------

_WHITESPACE = re.compile(r"\s")

MAX_VERSION = (1 << 53) - 1
"""Largest version the buffer stores: Redis' Lua keeps integers exact up to 2**53 (a larger
one, even within int64, comes back rounded or negative)."""

UNBOUNDED_RUN_RESUME_VERSION = 1_000_000
"""`buffer.max_resume_version` of a run without `total_train_steps` (it runs epochs)."""


def max_resume_version(configured: int | None, total_train_steps: int | None) -> int:
    """The highest version a buffer at version 0 takes in one jump (`buffer.max_resume_version`).

    Unset, it is derived from the run: a trainer's version equals its step until a resume
    finds the buffer or a replica ahead of its checkpoint (the dead trainer went on past it);
    then the restored weights take the next unused version, so each resume adds the steps
    its crash lost plus one. `2 * total_train_steps + 100` holds resumes that together lose
    a whole run's worth of steps; a run longer than that sets the field explicitly."""
    if configured is not None:
        return min(configured, MAX_VERSION)
    if total_train_steps is None:
        return UNBOUNDED_RUN_RESUME_VERSION
    return min(2 * total_train_steps + 100, MAX_VERSION)


def id_problem(value: str, *, allow_empty: bool = False) -> str | None:
    """Why `value` cannot be an id (None: it can). Ids become parts of Redis keys and of
    newline-separated script arguments, so they are printable, at most `MAX_ID_BYTES` bytes,
    and hold no whitespace or control characters."""
    if not value:
        return None if allow_empty else "must not be empty"
    if len(value.encode("utf-8", "surrogatepass")) > MAX_ID_BYTES:
        return f"is longer than {MAX_ID_BYTES} bytes"
    if value.isprintable() and _WHITESPACE.search(value) is None:  # C speed, the common case
        return None
    for ch in value:
        if ch.isspace() or not ch.isprintable():
            return f"holds {ch!r}: ids are printable, without whitespace or control characters"
    return None


def set_version_problem(version: int, current: int, max_resume: int = MAX_VERSION) -> str | None:
    """Why the buffer refuses to move from `current` to `version` (None: it may).

    The version moves at most one step ahead: each optimizer step sets the next one, and a
    resumed trainer sets the checkpoint's version or one past the highest it finds. The one
    exception is a buffer still at version 0 (new, or its Redis was replaced): a trainer
    resuming from a checkpoint onto it establishes its version in one jump, up to
    `max_resume` (see `max_resume_version`). A lower version is not refused here (that is
    the store's FAILED_PRECONDITION)."""
    if version < 0:
        return f"must be >= 0, got {version}"
    if version > MAX_VERSION:
        return f"{version} is above the largest storable version {MAX_VERSION}"
    if current == 0 and version > max_resume:
        return (
            f"{version} is above buffer.max_resume_version={max_resume}, the most a buffer at "
            "version 0 takes in one jump (a resuming trainer's checkpoint version); set "
            "buffer.max_resume_version to the checkpoint's version to resume a longer run"
        )
    if current > 0 and version > current + 1:
        return (
            f"{version} is more than one step ahead of the current version {current}: "
            "versions advance one optimizer step at a time"
        )
    return None


def put_version_problem(newest: int, current: int, eta: int) -> str | None:
    """Why a group whose newest token has `newest` cannot be put at buffer version `current`
    with staleness bound `eta` (None: it can): no token is generated by weights more than
    eta + 1 versions ahead of the trainer's (a rollout's weights are never ahead of the
    version the trainer published)."""
    limit = min(current + eta + 1, MAX_VERSION)
    if newest > limit:
        return (
            f"token version {newest} is beyond current version {current} + "
            f"max_head_offpolicyness {eta} + 1"
        )
    return None
