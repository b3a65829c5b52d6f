"""The contracts a user implements to extend Flywheel, and the one dotted-path loader.

Everything a config can name by dotted path has its signature here, so a user module
imports one place (`from services.api import ...`) and never a service's internals:

* `RewardFn`: one completion in, one float out (`reward.fn`, `reward.functions`);
* `RolloutWorkflow`, built as `cls(WorkflowContext, **rollout.workflow_kwargs)`, with the
  `InferenceEngine` protocol it generates with and the `RewardScorer` it scores with
  (`rollout.workflow`);
* `GroupFilter`: one trajectory group in, keep it or not (`buffer.filter`,
  `actor.should_accept_fn`); `rewards_filter` adapts the older `fn(rewards, **kwargs)` form;
* `Surrogate` with `SurrogateParams` / `SurrogateOutput`: the per-token policy loss
  (`actor.surrogate`);
* `GaeLambdaFn`: one GAE λ per trajectory (`actor.gae_lambda`);
* `load_dotted(path, kind)`: how every one of them is imported, with errors that name the
  config key, the module and the attribute.

This module imports neither torch nor any service: the buffer, the reward service and
`flywheel run --dry-run` load it without paying for torch. Tensor types appear only in
annotations. The services keep their old import paths (`services.reward.registry.RewardFn`,
`services.rollout.workflows.base.RolloutWorkflow`, ...), which re-export these names.
Worked examples of each contract: `docs/extending.md`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from services.common.codec import TrajectoryGroup
from services.rollout.types import Completion, SamplingParams

if TYPE_CHECKING:  # pragma: no cover - annotations only; this module stays torch-free
    from torch import Tensor


# --------------------------------------------------------------------------- loading


class DottedPathError(ValueError):
    """A dotted path that cannot be imported, or whose object does not fit its contract."""


def load_dotted(path: str, kind: str = "object", *, require_callable: bool = False) -> Any:
    """Import `package.module.attr` or `package.module:attr[.attr]` and return the object.

    `kind` names what is loaded, normally the config key (`"rollout.workflow"`), and starts
    every error message, so a typo in a YAML file is reported in words a user can act on:
    the module that cannot be imported (and why), or the attribute it lacks. Without a
    colon the last dot separates the module from the attribute; with one, everything after
    the colon is an attribute path (`pkg.mod:Class.method`). Any exception raised while
    the module is imported (a syntax error in user code, a missing dependency) is reported
    with its type; `require_callable` refuses an object that cannot be called.
    """
    if not isinstance(path, str) or not path.strip():
        raise DottedPathError(f"{kind}: expected a dotted path 'package.module.attr', got {path!r}")
    text = path.strip()
    if ":" in text:
        module_name, _, attr_path = text.partition(":")
    else:
        module_name, _, attr_path = text.rpartition(".")
    if not module_name or not attr_path:
        raise DottedPathError(f"{kind}: {path!r} is not a dotted path 'package.module.attr'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - user code may fail to import in any way
        raise DottedPathError(
            f"{kind}: cannot import module {module_name!r} of {path!r}: {type(exc).__name__}: {exc}"
        ) from exc
    owner = module_name
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise DottedPathError(f"{kind}: {owner!r} has no attribute {part!r}") from exc
        owner = f"{owner}.{part}"
    if require_callable and not callable(obj):
        raise DottedPathError(
            f"{kind}: {path!r} is a {type(obj).__name__}, not a callable (function or class)"
        )
    return obj


def accepts_positional(fn: Callable[..., Any], n: int) -> bool:
    """Whether `fn` can be called with `n` positional arguments (a structural check of a
    loaded function against a contract; objects without a signature pass)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    try:
        signature.bind(*([None] * n))
    except TypeError:
        return False
    return True


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

    `services.rollout.engine.base.InferenceEngine` is the abstract base both engines
    (torch, SGLang) derive from; it implements this protocol and adds the lifecycle and
    weight-update plumbing the rollout service drives. A workflow is typed against this
    protocol, so a test can hand it any object with these members.
    """

    version: int
    """Policy version of the weights serving now (each generated token carries its own)."""

    tokenizer: Any
    """The model's Hugging Face tokenizer, or None when the engine has none."""

    async def agenerate(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, *, request_id: str | None = None
    ) -> Completion:
        """One completion of `prompt_ids` (`sampling.n_samples` is ignored)."""
        ...

    async def agenerate_n(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, *, request_id: str | None = None
    ) -> list[Completion]:
        """`sampling.n_samples` completions of one prompt."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Token ids to text ('' without a tokenizer)."""
        ...


@dataclass(frozen=True)
class ScoreRequest:
    """One completion to score, in the reward function's terms."""

    completion: str
    answer: str = ""
    prompt: str = ""
    prompt_ids: Sequence[int] = ()
    completion_ids: Sequence[int] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ScoreResult:
    """The reward of one `ScoreRequest`; `ok` false with the reward service's status
    (`TIMEOUT`, `ERROR`, ...) and message when it could not be computed."""

    reward: float
    ok: bool = True
    status: str = "OK"
    message: str = ""


class RewardScorer(Protocol):
    """Scores completions; the rollout service's is the reward service's client."""

    async def score(self, items: Sequence[ScoreRequest]) -> list[ScoreResult]: ...


def _ignore_status(status: str) -> None:
    """The default `on_reward_failure`: nothing to count."""


@dataclass
class WorkflowContext:
    """Everything a workflow needs besides the engine and the row."""

    tokenizer: Any
    sampling: SamplingParams
    scorer: RewardScorer
    on_failure: Literal["zero", "drop_group"] = "zero"
    # Called with the reward status of every failed score (metrics).
    on_reward_failure: Callable[[str], None] = _ignore_status


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


def rewards_of(group: Any) -> list[float]:
    """The rewards of a group: a `TrajectoryGroup` (or anything with `.rewards`), a mapping
    with `"rewards"` (AReaL hands its filters a dict), or a plain sequence of floats."""
    if isinstance(group, Mapping):
        values = group["rewards"]
    elif hasattr(group, "rewards"):
        values = group.rewards
    else:
        values = group
    return [float(r) for r in values]


def rewards_filter(fn: Callable[..., bool], **kwargs: Any) -> GroupFilter:
    """Adapt `fn(rewards, **kwargs) -> bool` (a `RewardsFilter`, or any function of the
    rewards whose other arguments are bound here) to the `GroupFilter` signature.

    The adapted filter passes `rewards_of(group)` and the bound `kwargs`, and refuses a
    result that is not a `bool` (a truthy 1 or a numpy bool would hide a bug). Usable as a
    decorator. A dotted path in the config whose function's first parameter is named
    `rewards` is adapted this way automatically, so configs written for the older form
    keep working.
    """

    @functools.wraps(fn)
    def group_filter(group: Any) -> bool:
        result = fn(rewards_of(group), **kwargs)
        if not isinstance(result, bool):
            name = getattr(fn, "__qualname__", repr(fn))
            raise TypeError(f"group filter {name} returned {type(result).__name__}, expected bool")
        return result

    group_filter.__flywheel_rewards_filter__ = fn  # type: ignore[attr-defined]
    return group_filter


def is_rewards_filter(fn: Callable[..., Any]) -> bool:
    """Whether a loaded function has the older form: its first parameter is `rewards`
    (one `rewards_filter` already adapted is a group filter)."""
    if hasattr(fn, "__flywheel_rewards_filter__"):
        return False
    try:
        params = list(inspect.signature(fn, follow_wrapped=False).parameters)
    except (TypeError, ValueError):
        return False
    return bool(params) and params[0] == "rewards"


# --------------------------------------------------------------------- trainer side


@dataclass(frozen=True)
class SurrogateParams:
    """Knobs of the surrogates (AReaL names in the comments)."""

    eps_clip: float = 0.2  # eps_clip (lower clip, and upper when eps_clip_higher is None)
    eps_clip_higher: float | None = None  # eps_clip_higher (DAPO clip-higher)
    c_clip: float | None = None  # c_clip (dual clip, > 1)
    sapo_tau_pos: float = 1.0  # sapo_tau_pos
    sapo_tau_neg: float = 1.05  # sapo_tau_neg

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
    "Completion",
    "DottedPathError",
    "GaeLambdaFn",
    "GroupFilter",
    "InferenceEngine",
    "RewardFn",
    "RewardScorer",
    "RewardsFilter",
    "RolloutWorkflow",
    "SamplingParams",
    "ScoreRequest",
    "ScoreResult",
    "Surrogate",
    "SurrogateOutput",
    "SurrogateParams",
    "TrajectoryGroup",
    "WorkflowContext",
    "accepts_positional",
    "is_rewards_filter",
    "load_dotted",
    "rewards_filter",
    "rewards_of",
]
