"""The contracts a user implements to extend Flywheel: one `Protocol` per extension point.

Everything a config can name by dotted path has its signature here:

* `RewardFn`: one completion in, one float out (`reward.fn`, `reward.functions`);
* `RolloutWorkflow`, built as `cls(WorkflowContext, **rollout.workflow_kwargs)`, with the
  `InferenceEngine` it generates with and the `RewardScorer` it scores with
  (`rollout.workflow`);
* `GroupFilter`: one trajectory group in, keep it or not (`buffer.filter`,
  `actor.should_accept_fn`); `RewardsFilter` is the older `fn(rewards, **kwargs)` form
  (`services.core.filters.rewards_filter` adapts it);
* `Surrogate` with `SurrogateParams` / `SurrogateOutput`: the per-token policy loss
  (`actor.surrogate`);
* `GaeLambdaFn`: one GAE λ per trajectory (`actor.gae_lambda`).

Torch-free: tensor types appear only in annotations. Worked examples of each contract:
`docs/extending.md`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from services.core.types import (
    Completion,
    SamplingParams,
    ScoreRequest,
    ScoreResult,
    TrajectoryGroup,
)

if TYPE_CHECKING:  # pragma: no cover - annotations only; this module stays torch-free
    from torch import Tensor


# --------------------------------------------------------------------------- rewards


class RewardFn(Protocol):
    """One completion in, one finite float out; run in the reward service's workers.

    `completions` is a single string (AReaL's name); `**kwargs` receives the data row's
    other JSON-valued fields and `reward.fn_kwargs`."""

    def __call__(
        self,
        prompt: str,
        completions: str,
        prompt_ids: list[int],
        completion_ids: list[int],
        answer: str,
        **kwargs: Any,
    ) -> float: ...


# --------------------------------------------------------------------- rollout side


@runtime_checkable
class InferenceEngine(Protocol):
    """What a workflow may ask of the engine: generate, decode, and the policy version.

    The one engine contract. `services.rollout.engine.base.EngineBase`, the abstract base
    both engines (torch, SGLang) derive from, implements it and adds the lifecycle and
    weight-update plumbing the rollout service drives. A workflow is typed against this
    protocol, so a test can hand it any object with these members.
    """

    version: int
    """Policy version of the weights serving now (each generated token carries its own)."""

    tokenizer: Any
    """The model's Hugging Face tokenizer, or None when the engine has none."""

    async def agenerate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        request_id: str | None = None,
        images: Sequence[bytes] | None = None,
    ) -> Completion:
        """One completion of `prompt_ids` (`sampling.n_samples` is ignored).

        `images`: the prompt's encoded images (PNG/JPEG bytes) in the order of the image
        placeholders in `prompt_ids`; an engine serving a text-only model refuses them with
        `ValueError` rather than dropping them."""
        ...

    async def agenerate_n(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        request_id: str | None = None,
        images: Sequence[bytes] | None = None,
    ) -> list[Completion]:
        """`sampling.n_samples` completions of one prompt (with its `images`, if any)."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Token ids to text ('' without a tokenizer)."""
        ...


class RewardScorer(Protocol):
    """Scores completions; the rollout service's is the reward service's client."""

    async def score(self, items: Sequence[ScoreRequest]) -> list[ScoreResult]: ...


def _ignore_status(status: str) -> None:
    """The default `on_reward_failure`: nothing to count."""


def _ignore_images(images: int, image_tokens: int, processor_seconds: float) -> None:
    """The default `on_images`: nothing to count."""


@dataclass
class WorkflowContext:
    """Everything a workflow needs besides the engine and the row."""

    tokenizer: Any
    sampling: SamplingParams
    scorer: RewardScorer
    on_failure: Literal["zero", "drop_group"] = "zero"
    # Called with the reward status of every failed score (metrics).
    on_reward_failure: Callable[[str], None] = _ignore_status
    # The model's processor (chat template with image placeholders, image processor) when
    # it reads images (`vision_rlvr`); None for a text model.
    processor: Any = None
    # Called once per prompt with images: how many, the prompt's image tokens, and the
    # seconds the processor took to build the prompt (metrics).
    on_images: Callable[[int, int, float], None] = _ignore_images


@runtime_checkable
class RolloutWorkflow(Protocol):
    """One data row → one scored `TrajectoryGroup` of `n_samples` completions, or None to
    skip the row. Built as `cls(ctx: WorkflowContext, **rollout.workflow_kwargs)`."""

    async def arun_episode(
        self, engine: InferenceEngine, data: dict[str, Any]
    ) -> TrajectoryGroup | None: ...


# --------------------------------------------------------------------- group filters


class GroupFilter(Protocol):
    """Keep a group of one prompt's completions (True) or drop it (False).

    The one filter signature, for `buffer.filter` (applied by the buffer) and
    `actor.should_accept_fn` (applied by the trainer): the group is a `TrajectoryGroup`
    (`group.rewards`, `group.trajectories`, `group.oldest_version`, ...). The result must
    be a real `bool`.
    """

    def __call__(self, group: TrajectoryGroup) -> bool: ...


class RewardsFilter(Protocol):
    """The older filter form, `fn(rewards, **kwargs) -> bool`, over one group's rewards;
    `rewards_filter` turns it into a `GroupFilter`."""

    def __call__(self, rewards: Sequence[float], **kwargs: Any) -> bool: ...


# --------------------------------------------------------------------- trainer side


@dataclass(frozen=True)
class SurrogateParams:
    """Knobs of the surrogates, the actor config's fields of the same names; their defaults
    and rules are the config schema's (`PPOActorConfig`), checked at load."""

    eps_clip: float  # lower clip, and upper when eps_clip_higher is None
    eps_clip_higher: float | None  # DAPO clip-higher
    c_clip: float | None  # dual clip, > 1
    sapo_tau_pos: float
    sapo_tau_neg: float

    @property
    def eps_low(self) -> float:
        return self.eps_clip

    @property
    def eps_high(self) -> float:
        return self.eps_clip if self.eps_clip_higher is None else self.eps_clip_higher


@dataclass
class SurrogateOutput:
    """What a surrogate returns, all per token."""

    per_token_loss: Tensor
    clipped: Tensor  # bool: where the (upper/lower) clip decided the value
    dual_clipped: Tensor  # bool: where the dual clip decided the value
    extra: dict[str, Tensor] = field(default_factory=dict)  # per-token tensors for stats


class Surrogate(Protocol):
    """`(ratio, advantages, logprobs, params) -> SurrogateOutput`, all per token.

    `ratio` is π_θ/π_prox (token or GSPO sequence ratio), `advantages` carry no gradient,
    `logprobs` is log π_θ (with gradient). The loss is multiplied by the behaviour weight
    and aggregated by the caller; the masks feed the clip statistics."""

    def __call__(
        self, ratio: Tensor, advantages: Tensor, logprobs: Tensor, params: SurrogateParams
    ) -> SurrogateOutput: ...


GaeLambdaFn = Callable[..., "Tensor"]
"""`fn(context, **gae_lambda_kwargs) -> Tensor[B]` of finite λ in [0, 1], one per
trajectory. `context` maps `effective_token_lengths`, `turn_counts` and `timestep_lengths`
to `[B]` tensors. A Callable rather than a Protocol: each function names its own keyword
arguments, so a typo in `gae_lambda_kwargs` is a TypeError instead of being swallowed."""


__all__ = [
    "GaeLambdaFn",
    "GroupFilter",
    "InferenceEngine",
    "RewardFn",
    "RewardScorer",
    "RewardsFilter",
    "RolloutWorkflow",
    "Surrogate",
    "SurrogateOutput",
    "SurrogateParams",
    "WorkflowContext",
]
