"""Plain data types of the rollout service, shared by engines, workflows, servicer and client.

No torch here: the client and the config layer import these without pulling a model stack.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

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

    def to_proto(self) -> Any:
        from flywheel_proto.v1 import rollout_pb2

        return rollout_pb2.SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(0, min(self.top_k, 2**31 - 1)),
            greedy=self.greedy,
            max_new_tokens=self.max_new_tokens,
            min_new_tokens=self.min_new_tokens,
            max_tokens=max(0, min(self.max_tokens, 2**31 - 1)),
            stop_token_ids=list(self.stop_token_ids),
            stop=list(self.stop),
            seed=self.seed or 0,
            has_seed=self.seed is not None,
            n_samples=self.n_samples,
            ignore_eos=self.ignore_eos,
            frequency_penalty=self.frequency_penalty,
            skip_special_tokens=self.skip_special_tokens,
        )

    @classmethod
    def from_proto(cls, msg: Any) -> SamplingParams:
        """Proto3 zeros mean "unset" for counts: n_samples 0 -> 1, max_new_tokens 0 -> default."""
        default = cls()
        return cls(
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

    def to_proto(self) -> Any:
        from flywheel_proto.v1 import rollout_pb2

        return rollout_pb2.Completion(
            output_ids=self.output_ids,
            logprobs=self.logprobs,
            versions=self.versions,
            stop_reason=self.stop_reason,
            text=self.text,
        )

    @classmethod
    def from_proto(cls, msg: Any) -> Completion:
        return cls(
            output_ids=list(msg.output_ids),
            logprobs=list(msg.logprobs),
            versions=list(msg.versions),
            stop_reason=msg.stop_reason,  # type: ignore[arg-type]
            text=msg.text,
        )


@dataclass
class UpdateResult:
    """Outcome of a weight update. `ok=False` means the old weights still serve, `message`
    says why, and `version` is the (old) version served."""

    ok: bool
    version: int
    message: str = ""
    pause_seconds: float = 0.0
    total_seconds: float = 0.0

    def raise_for_status(self) -> UpdateResult:
        if not self.ok:
            raise RuntimeError(
                f"weight update refused (still serving v{self.version}): {self.message}"
            )
        return self

    def to_proto(self) -> Any:
        from flywheel_proto.v1 import rollout_pb2

        return rollout_pb2.UpdateWeightsResponse(
            ok=self.ok,
            version=self.version,
            message=self.message,
            pause_seconds=self.pause_seconds,
            total_seconds=self.total_seconds,
        )

    @classmethod
    def from_proto(cls, msg: Any) -> UpdateResult:
        return cls(msg.ok, msg.version, msg.message, msg.pause_seconds, msg.total_seconds)


@dataclass
class RolloutStatsView:
    """What `Stats` reports about one replica."""

    version: int
    requests_in_flight: int
    groups_produced: int
    tokens_generated: int
    paused: bool
    rejected: dict[str, int]
    rollout_id: str
    checksum: str = ""
    draining: bool = False
    weight_updates: int = 0
    weight_updates_failed: int = 0
    last_update_error: str = ""
    engine: str = ""

    @classmethod
    def from_proto(cls, msg: Any) -> RolloutStatsView:
        return cls(
            version=msg.version,
            requests_in_flight=msg.requests_in_flight,
            groups_produced=msg.groups_produced,
            tokens_generated=msg.tokens_generated,
            paused=msg.paused,
            rejected=dict(msg.rejected),
            rollout_id=msg.rollout_id,
            checksum=msg.checksum,
            draining=msg.draining,
            weight_updates=msg.weight_updates,
            weight_updates_failed=msg.weight_updates_failed,
            last_update_error=msg.last_update_error,
            engine=msg.engine,
        )
