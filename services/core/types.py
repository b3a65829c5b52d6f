"""The plain data types several services share: trajectories, sampling, completions, scores.

A `TrajectoryGroup` is what the rollout service produces, the buffer stores and the trainer
consumes; `SamplingParams` and `Completion` are what a workflow asks an engine for and gets
back; `ScoreRequest` and `ScoreResult` are what a workflow hands the reward service and
gets back. Conversions to and from protobuf live in the wire layer
(`services.common.codec`), not here: this module imports only the standard library and
numpy, so every service, the config layer and user plugins import it without grpc or torch.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import numpy as np

# ------------------------------------------------------------------- trajectories


@dataclass
class Trajectory:
    """One completion, token-aligned. Field meanings: proto/flywheel/v1/common.proto."""

    trajectory_id: str
    group_id: str
    input_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    reward: float
    no_eos: bool
    prompt_len: int
    stop_reason: str = "stop"
    turn_ids: np.ndarray | None = None
    metadata: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.input_ids = np.asarray(self.input_ids, dtype=np.int64)
        self.loss_mask = np.asarray(self.loss_mask, dtype=np.int8)
        self.logprobs = np.asarray(self.logprobs, dtype=np.float32)
        self.versions = np.asarray(self.versions, dtype=np.int64)
        if self.turn_ids is not None:
            self.turn_ids = np.asarray(self.turn_ids, dtype=np.int64)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def generated_versions(self) -> np.ndarray:
        return self.versions[self.loss_mask.astype(bool)]


@dataclass
class TrajectoryGroup:
    """The completions of one prompt: the unit the buffer admits, stores and serves."""

    group_id: str
    trajectories: list[Trajectory]
    prompt_id: str = ""
    reservation_id: str = ""
    rollout_id: str = ""
    created_unix_ms: int = 0
    metadata: dict[str, str] = field(default_factory=dict)
    images: list[bytes] = field(default_factory=list)
    """The prompt's images, encoded (PNG/JPEG bytes), in prompt order; empty for text.

    Carried once per group, not per sample: every completion of the group shares the
    prompt, and encoded bytes are a fraction of the pixel tensors the processor rebuilds
    from them where they are needed (the trainer)."""

    @property
    def oldest_version(self) -> int:
        """Oldest policy version of any generated token (the staleness that matters)."""
        gens = [t.generated_versions for t in self.trajectories if t.generated_versions.size]
        return int(min(int(g.min()) for g in gens)) if gens else -1

    @property
    def newest_version(self) -> int:
        gens = [t.generated_versions for t in self.trajectories if t.generated_versions.size]
        return int(max(int(g.max()) for g in gens)) if gens else -1

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    @property
    def nbytes(self) -> int:
        return sum(
            t.input_ids.nbytes + t.loss_mask.nbytes + t.logprobs.nbytes + t.versions.nbytes
            for t in self.trajectories
        ) + sum(len(image) for image in self.images)


# --------------------------------------------------------------- sampling, completions


StopReason = Literal["stop", "length", "abort"]
NO_TOP_K = 0
"""`top_k` value meaning "no limit" on the wire (AReaL's huge default maps to it)."""


@dataclass
class SamplingParams:
    """How one request samples. Names and meanings follow `GenerationHyperparameters`.

    `temperature == 0` or `greedy` picks the arg-max; log-probabilities are then those of the
    temperature-1 distribution (there is no other defined one). `max_tokens` caps prompt +
    completion (0 = no cap). `top_k <= 0` or above the vocabulary means no limit.
    """

    n_samples: int = 1
    max_new_tokens: int = 16384
    min_new_tokens: int = 0
    max_tokens: int = 0
    greedy: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = NO_TOP_K
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    seed: int | None = None

    def validate(self) -> SamplingParams:
        """Raise `ValueError` naming the bad field and its allowed range; returns self."""
        if self.n_samples < 1:
            raise ValueError(f"sampling.n_samples={self.n_samples}: must be >= 1")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens={self.max_new_tokens}: must be >= 1")
        if self.min_new_tokens < 0 or self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"sampling.min_new_tokens={self.min_new_tokens}: must be in "
                f"[0, max_new_tokens={self.max_new_tokens}]"
            )
        if self.max_tokens < 0:
            raise ValueError(f"sampling.max_tokens={self.max_tokens}: must be >= 0 (0 = no cap)")
        if not self.temperature >= 0.0:
            raise ValueError(f"sampling.temperature={self.temperature}: must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling.top_p={self.top_p}: must be in (0, 1]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(
                f"sampling.frequency_penalty={self.frequency_penalty}: must be in [-2, 2]"
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"sampling.stop_token_ids={self.stop_token_ids}: ids must be >= 0")
        if any(not s for s in self.stop):
            raise ValueError("sampling.stop: empty stop strings are not allowed")
        return self

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0.0

    @classmethod
    def from_gconfig(cls, gconfig: Any, **overrides: Any) -> SamplingParams:
        """From a `GenerationHyperparameters` (or anything with the same attributes)."""
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            if hasattr(gconfig, f.name):
                kwargs[f.name] = getattr(gconfig, f.name)
        kwargs["stop"] = list(kwargs.get("stop") or [])
        kwargs["stop_token_ids"] = list(kwargs.get("stop_token_ids") or [])
        kwargs.update(overrides)
        return cls(**kwargs).validate()


@dataclass
class Completion:
    """One generated completion, aligned token by token.

    `logprobs[i]` is the behaviour log-probability of `output_ids[i]` under the sampling
    temperature; `versions[i]` the policy version whose weights produced it.
    """

    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    stop_reason: StopReason
    text: str = ""
    prompt_ids: list[int] = field(default_factory=list)

    @property
    def no_eos(self) -> bool:
        return self.stop_reason != "stop"


# ------------------------------------------------------------------------- scoring


class RewardStatus(enum.StrEnum):
    """Why a score is what it is; a `StrEnum`, so it compares equal to its name."""

    OK = "OK"
    TIMEOUT = "TIMEOUT"  # the deadline passed; the worker was killed and replaced
    ERROR = "ERROR"  # the function raised or broke a limit; `message` says what
    INVALID_INPUT = "INVALID_INPUT"  # not scorable: invalid UTF-8, too large, bad kwargs


@dataclass(frozen=True)
class ScoreRequest:
    """One completion to score, in the reward function's terms.

    `kwargs` are the data row's other fields the function receives as keyword arguments
    (JSON-serialisable; not named like a positional parameter). `fn` and `deadline_ms`
    override the call's function and deadline for this item ("" / 0: the call's, else the
    reward service's defaults)."""

    completion: str | bytes
    answer: str = ""
    prompt: str = ""
    prompt_ids: Sequence[int] = ()
    completion_ids: Sequence[int] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    fn: str = ""
    deadline_ms: int = 0


@dataclass(frozen=True)
class ScoreResult:
    """The reward of one `ScoreRequest`. With `ok` false the reward could not be computed
    (`reward` is then 0.0 and the caller's `reward.on_failure` decides); `status` is a
    `RewardStatus` name (`TIMEOUT`, `ERROR`, ...) and `message` says what happened.
    `cached` and `seconds` are what the reward service reports about the computation."""

    reward: float
    ok: bool = True
    status: str = RewardStatus.OK
    message: str = ""
    cached: bool = False
    seconds: float = 0.0


__all__ = [
    "NO_TOP_K",
    "Completion",
    "RewardStatus",
    "SamplingParams",
    "ScoreRequest",
    "ScoreResult",
    "StopReason",
    "Trajectory",
    "TrajectoryGroup",
]
