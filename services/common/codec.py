"""The shared types between Python and the wire, trajectories validated on the way in.

The types themselves live in `services.core.types`; this module converts them to and from
their protobuf messages (`Trajectory`, `TrajectoryGroup`, `SamplingParams`, `Completion`).

Tensors travel as dtype + shape + packed little-endian bytes (never pickle), so a peer in
any language can read them and a malicious peer cannot execute code. Decoding checks
everything a later stage would otherwise trip over at step 300: byte lengths, aligned
per-token fields, the prompt/version convention and finite log-probabilities. Every
violation raises `CodecError` with the reason; callers turn it into INVALID_ARGUMENT.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from flywheel_proto.v1 import common_pb2, rollout_pb2
from services.common.image_bytes import ImageLimits, images_problem
from services.core.types import Completion, SamplingParams, Trajectory, TrajectoryGroup

_DTYPES: dict[str, np.dtype] = {
    "bool": np.dtype("bool"),
    "int8": np.dtype("<i1"),
    "uint8": np.dtype("<u1"),
    "int16": np.dtype("<i2"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_INT_KINDS = ("int8", "int16", "int32", "int64", "uint8")


class CodecError(ValueError):
    """A message that cannot be decoded into a valid trajectory; `reason` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class CodecLimits:
    """Upper bounds applied while decoding, so one bad peer cannot exhaust memory."""

    max_tokens: int = 1 << 20
    max_trajectories: int = 1024
    max_metadata_bytes: int = 64 << 10
    images: ImageLimits = ImageLimits()
    """Count, bytes and pixels of a group's encoded images (`services.common.image_bytes`)."""


def array_to_tensor(arr: np.ndarray) -> common_pb2.Tensor:
    arr = np.asarray(arr)
    dtype = arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype
    name = _NAMES.get(np.dtype(dtype))
    if name is None:
        raise CodecError(f"unsupported dtype {arr.dtype}")
    data = np.ascontiguousarray(arr, dtype=_DTYPES[name]).tobytes()
    return common_pb2.Tensor(dtype=name, shape=list(arr.shape), data=data)


def tensor_to_array(msg: common_pb2.Tensor, max_elements: int = 1 << 24) -> np.ndarray:
    """Decode a Tensor, checking that its bytes match its dtype and shape exactly."""
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise CodecError(f"unknown dtype {msg.dtype!r}; expected one of {sorted(_DTYPES)}")
    shape = tuple(int(s) for s in msg.shape)
    if any(s < 0 for s in shape):
        raise CodecError(f"negative dimension in shape {shape}")
    n = math.prod(shape)
    if n > max_elements:
        raise CodecError(f"tensor of {n} elements exceeds the limit of {max_elements}")
    if len(msg.data) != n * dtype.itemsize:
        raise CodecError(
            f"byte length {len(msg.data)} != prod(shape {shape}) x itemsize {dtype.itemsize}"
        )
    return np.frombuffer(msg.data, dtype=dtype).reshape(shape).copy()


def trajectory_to_proto(t: Trajectory) -> common_pb2.Trajectory:
    msg = common_pb2.Trajectory(
        trajectory_id=t.trajectory_id,
        group_id=t.group_id,
        input_ids=array_to_tensor(t.input_ids),
        loss_mask=array_to_tensor(t.loss_mask),
        logprobs=array_to_tensor(t.logprobs),
        versions=array_to_tensor(t.versions),
        reward=float(t.reward),
        no_eos=bool(t.no_eos),
        prompt_len=int(t.prompt_len),
        stop_reason=t.stop_reason,
        metadata=dict(t.metadata),
    )
    if t.turn_ids is not None:
        msg.turn_ids.CopyFrom(array_to_tensor(t.turn_ids))
    return msg


def _one_dim(name: str, arr: np.ndarray) -> np.ndarray:
    if arr.ndim != 1:
        raise CodecError(f"{name} must be 1-D, got shape {arr.shape}")
    return arr


def trajectory_from_proto(
    msg: common_pb2.Trajectory, limits: CodecLimits = CodecLimits()
) -> Trajectory:
    """Decode and validate one trajectory; raises CodecError naming the first violation."""
    if not msg.trajectory_id:
        raise CodecError("trajectory_id is empty")
    where = f"trajectory {msg.trajectory_id!r}"
    fields: dict[str, np.ndarray] = {}
    for name in ("input_ids", "loss_mask", "logprobs", "versions"):
        if not msg.HasField(name):
            raise CodecError(f"{where}: {name} is missing")
        try:
            fields[name] = _one_dim(name, tensor_to_array(getattr(msg, name), limits.max_tokens))
        except CodecError as err:
            raise CodecError(f"{where}: {name}: {err.reason}") from None
    turn_ids = None
    if msg.HasField("turn_ids"):
        try:
            turn_ids = _one_dim("turn_ids", tensor_to_array(msg.turn_ids, limits.max_tokens))
        except CodecError as err:
            raise CodecError(f"{where}: turn_ids: {err.reason}") from None
        fields["turn_ids"] = turn_ids
    lengths = {k: int(v.shape[0]) for k, v in fields.items()}
    if len(set(lengths.values())) != 1:
        raise CodecError(f"{where}: per-token fields differ in length: {lengths}")
    n = lengths["input_ids"]
    if n == 0:
        raise CodecError(f"{where}: no tokens")
    if msg.input_ids.dtype not in _INT_KINDS or msg.versions.dtype not in _INT_KINDS:
        raise CodecError(f"{where}: input_ids and versions must be integer tensors")
    if msg.logprobs.dtype not in ("float16", "float32", "float64"):
        raise CodecError(f"{where}: logprobs must be a float tensor, got {msg.logprobs.dtype}")
    mask = fields["loss_mask"]
    if mask.size and (mask.min() < 0 or mask.max() > 1):
        raise CodecError(f"{where}: loss_mask must hold only 0 and 1")
    prompt_len = int(msg.prompt_len)
    if not 0 < prompt_len <= n:
        raise CodecError(f"{where}: prompt_len {prompt_len} outside [1, {n}]")
    if mask[:prompt_len].any():
        raise CodecError(f"{where}: loss_mask is 1 inside the prompt (first {prompt_len} tokens)")
    versions = fields["versions"]
    if (versions[:prompt_len] != -1).any():
        raise CodecError(f"{where}: versions must be -1 on the {prompt_len} prompt tokens")
    if (versions[mask.astype(bool)] < 0).any():
        raise CodecError(f"{where}: generated tokens (loss_mask=1) need a version >= 0")
    logprobs = fields["logprobs"].astype(np.float32)
    if not np.isfinite(logprobs).all():
        raise CodecError(f"{where}: logprobs contain NaN or Inf")
    if (logprobs > 1e-4).any():
        raise CodecError(f"{where}: logprobs must be <= 0 (log-probabilities)")
    if not math.isfinite(msg.reward):
        raise CodecError(f"{where}: reward is not finite")
    if (fields["input_ids"] < 0).any():
        raise CodecError(f"{where}: negative token id")
    meta = dict(msg.metadata)
    if sum(len(k) + len(v) for k, v in meta.items()) > limits.max_metadata_bytes:
        raise CodecError(f"{where}: metadata larger than {limits.max_metadata_bytes} bytes")
    return Trajectory(
        trajectory_id=msg.trajectory_id,
        group_id=msg.group_id,
        input_ids=fields["input_ids"],
        loss_mask=mask,
        logprobs=logprobs,
        versions=versions,
        reward=float(msg.reward),
        no_eos=bool(msg.no_eos),
        prompt_len=prompt_len,
        stop_reason=msg.stop_reason or "stop",
        turn_ids=turn_ids,
        metadata=meta,
    )


def group_to_proto(g: TrajectoryGroup) -> common_pb2.TrajectoryGroup:
    return common_pb2.TrajectoryGroup(
        group_id=g.group_id,
        trajectories=[trajectory_to_proto(t) for t in g.trajectories],
        prompt_id=g.prompt_id,
        reservation_id=g.reservation_id,
        rollout_id=g.rollout_id,
        created_unix_ms=int(g.created_unix_ms),
        metadata=dict(g.metadata),
        images=list(g.images),
    )


def group_from_proto(
    msg: common_pb2.TrajectoryGroup, limits: CodecLimits = CodecLimits()
) -> TrajectoryGroup:
    """Decode and validate a whole group; the group is the unit, so one bad member rejects it."""
    if not msg.group_id:
        raise CodecError("group_id is empty")
    if not msg.trajectories:
        raise CodecError(f"group {msg.group_id!r} has no trajectories")
    if len(msg.trajectories) > limits.max_trajectories:
        raise CodecError(
            f"group {msg.group_id!r} has {len(msg.trajectories)} trajectories "
            f"(limit {limits.max_trajectories})"
        )
    trajectories = [trajectory_from_proto(t, limits) for t in msg.trajectories]
    ids = [t.trajectory_id for t in trajectories]
    if len(set(ids)) != len(ids):
        raise CodecError(f"group {msg.group_id!r} repeats a trajectory_id")
    for t in trajectories:
        if t.group_id and t.group_id != msg.group_id:
            raise CodecError(
                f"trajectory {t.trajectory_id!r} says group {t.group_id!r}, "
                f"inside group {msg.group_id!r}"
            )
    images = list(msg.images)
    problem = images_problem(images, limits.images)
    if problem is not None:
        raise CodecError(f"group {msg.group_id!r}: {problem}")
    return TrajectoryGroup(
        group_id=msg.group_id,
        trajectories=trajectories,
        prompt_id=msg.prompt_id,
        reservation_id=msg.reservation_id,
        rollout_id=msg.rollout_id,
        created_unix_ms=int(msg.created_unix_ms),
        metadata=dict(msg.metadata),
        images=images,
    )


def sampling_to_proto(p: SamplingParams) -> rollout_pb2.SamplingParams:
    return rollout_pb2.SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=max(0, min(p.top_k, 2**31 - 1)),
        greedy=p.greedy,
        max_new_tokens=p.max_new_tokens,
        min_new_tokens=p.min_new_tokens,
        max_tokens=max(0, min(p.max_tokens, 2**31 - 1)),
        stop_token_ids=list(p.stop_token_ids),
        stop=list(p.stop),
        seed=p.seed or 0,
        has_seed=p.seed is not None,
        n_samples=p.n_samples,
        ignore_eos=p.ignore_eos,
        frequency_penalty=p.frequency_penalty,
        skip_special_tokens=p.skip_special_tokens,
    )


def sampling_from_proto(msg: rollout_pb2.SamplingParams) -> SamplingParams:
    """Proto3 zeros mean "unset" for counts: n_samples 0 -> 1, max_new_tokens 0 -> default."""
    default = SamplingParams()
    return SamplingParams(
        n_samples=msg.n_samples or 1,
        max_new_tokens=msg.max_new_tokens or default.max_new_tokens,
        min_new_tokens=msg.min_new_tokens,
        max_tokens=msg.max_tokens,
        greedy=msg.greedy,
        temperature=msg.temperature,
        top_p=msg.top_p or 1.0,
        top_k=msg.top_k,
        stop_token_ids=list(msg.stop_token_ids),
        stop=list(msg.stop),
        ignore_eos=msg.ignore_eos,
        frequency_penalty=msg.frequency_penalty,
        skip_special_tokens=msg.skip_special_tokens,
        seed=msg.seed if msg.has_seed else None,
    ).validate()


def completion_to_proto(c: Completion) -> rollout_pb2.Completion:
    return rollout_pb2.Completion(
        output_ids=c.output_ids,
        logprobs=c.logprobs,
        versions=c.versions,
        stop_reason=c.stop_reason,
        text=c.text,
    )


def completion_from_proto(msg: rollout_pb2.Completion) -> Completion:
    return Completion(
        output_ids=list(msg.output_ids),
        logprobs=list(msg.logprobs),
        versions=list(msg.versions),
        stop_reason=msg.stop_reason,  # type: ignore[arg-type]
        text=msg.text,
    )
