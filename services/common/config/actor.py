"""Policy, critic and reference model blocks: AReaL's `PPOActorConfig` family.

Field names and defaults are AReaL's (inclusionAI/AReaL `areal/api/cli_args.py`) so that
an AReaL YAML carries over; the few Flywheel additions are marked "Flywheel:" in their
docstrings, and the few deliberate default differences are listed in
`tests/common/config/test_config_defaults.py` (DEVIATIONS) with the reason for each.

The blocks they are made of have modules of their own: `train_engine.py` (what every trained
model shares: precision, micro-batches, FSDP, the optimizer's place), `optimizer.py`,
`normalization.py` and `rejection_sampling.py`.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from ._base import RuleViolation
from .normalization import NormConfig
from .rejection_sampling import REJECTION_SAMPLING_MIGRATION, RejectionSamplingConfig
from .train_engine import TrainEngineConfig

ProxLogpMethod = Literal["recompute", "loglinear", "linear", "metrics", "reuse_train_logp"]
LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]

BUILTIN_SURROGATES = ("clip", "sapo", "cispo")
"""The surrogates `actor.surrogate` names without a dotted path (the trainer's registry
`services.trainer.algorithms.surrogates.SURROGATES` holds them)."""

_IDENT = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
_DOTTED_PATH = re.compile(rf"{_IDENT}(?::|\.){_IDENT}")


class PPOActorConfig(TrainEngineConfig):
    """The policy and everything that turns rewards into its loss.

    A preset (GRPO, Dr.GRPO, DAPO, GSPO, SAPO, CISPO, IcePop, KPop, M2PO, ...) is a
    combination of these fields; see `examples/`.
    """

    group_size: int = Field(default=1, ge=1)
    """Samples per prompt group as the trainer sees it (normally `gconfig.n_samples`)."""

    ppo_n_minibatches: int = Field(default=4, ge=1)
    """Optimizer steps per training batch; the batch is split into this many minibatches."""

    eps_clip: float = Field(default=0.2, ge=0.0)
    """PPO clip ε: the ratio is clipped to [1-ε, 1+ε] (lower bound when
    `eps_clip_higher` is set)."""

    eps_clip_higher: float | None = None
    """Upper clip ε (DAPO clip-higher); null means symmetric `eps_clip`."""

    c_clip: float | None = None
    """Dual-clip bound (> 1) for negative advantages; null disables dual clipping."""

    m2_threshold: float | None = None
    """M2PO: mask tokens until the second moment of log-ratios is below this; null disables."""

    reward_norm: NormConfig | None = None
    """Normalisation of scalar rewards before advantages; null leaves them as they are."""

    reward_scaling: float = 1.0
    """Rewards are multiplied by this (after the bias)."""

    reward_bias: float = 0.0
    """Added to rewards before scaling."""

    reward_clip: float = Field(default=20.0, gt=0.0)
    """Rewards are clipped to [-reward_clip, reward_clip]."""

    overlong_reward_penalty: bool = False
    """DAPO soft overlong punishment on completions longer than
    `max_new_tokens - overlong_tokens`."""

    overlong_tokens: int | None = Field(default=None, ge=1)
    """Length of the tail (in tokens) in which the overlong penalty ramps up."""

    overlong_penalty_factor: float | None = Field(default=None, ge=0.0)
    """Slope of the overlong penalty: −factor · (L − (max_new_tokens − overlong_tokens)) /
    overlong_tokens for L generated tokens past the threshold, so −factor at
    `max_new_tokens` and linear (not capped) beyond, as AReaL."""

    mask_no_eos_with_zero: bool = False
    """Set the outcome reward of a truncated completion (no EOS, from the trajectory's
    `no_eos` flag) to 0 after `reward_norm`, as AReaL's code does: the normalisation
    statistics still include its reward, and its tokens stay in the loss with their KL
    reward. To leave truncated completions out of training, use `overlong_filtering`."""

    overlong_filtering: bool = False
    """Flywheel: DAPO's overlong filtering: a truncated completion (no EOS) leaves
    training: its tokens leave the actor's and the critic's loss mask, its reward is left
    out of the `reward_norm` statistics (and reported as 0). Excludes
    `mask_no_eos_with_zero`, which it makes redundant."""

    discount: float = Field(default=1.0, ge=0.0, le=1.0)
    """GAE discount γ."""

    gae_lambda: float | str = 1.0
    """GAE λ: a number in [0, 1], or the dotted path of a function that returns one λ
    per trajectory (built-ins: `constant`, `vapo_length_adaptive`, `relative_position`)."""

    gae_lambda_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the λ function; free-form (ignored for a numeric λ)."""

    gae_timestep_unit: Literal["token", "turn"] = "token"
    """GAE steps per token, or once per generated turn (multi-turn, uses `turn_ids`)."""

    adv_norm: NormConfig | None = None
    """Normalisation of advantages after GAE; null leaves them as they are."""

    min_usable_group_size: int | None = Field(default=None, ge=1)
    """Fewest surviving samples a group needs to be trained on after failures/filters;
    null: 2 when a norm works at group level, else 1."""

    kl_ctl: float = Field(default=0.0, ge=0.0)
    """Coefficient of the KL penalty against the reference model (`ref`); > 0 requires a
    `ref` with a path. Default 0, where AReaL's is 0.1: AReaL builds a reference model only
    when `ref` is set, and without one takes the KL against zeros (a surprisal bonus), so
    its default 0.1 with no `ref` is no KL penalty either; its examples all set 0.0."""

    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """KL estimator used for the reward penalty."""

    kl_clamp: float | None = Field(default=10.0, gt=0.0)
    """Flywheel: each token's KL estimate is clamped to [-kl_clamp, kl_clamp] before it is
    multiplied by `kl_ctl` (AReaL clamps at a fixed 10); null turns the clamp off."""

    surrogate: str = "clip"
    """Flywheel: the policy-loss surrogate: `clip` (PPO, with `eps_clip_higher` and
    `c_clip`), `sapo` (soft sigmoid gates), `cispo` (clipped, stop-gradient weight on
    log π_θ), or the dotted path of your own `services.api.Surrogate`. AReaL's
    `use_sapo_loss` / `use_cispo_loss` set it to `sapo` / `cispo`; a value that
    contradicts them fails at load."""

    use_sapo_loss: bool = False
    """SAPO: replace the hard clip by soft sigmoid gates (AReaL's spelling of
    `surrogate: sapo`; kept equal to it)."""

    sapo_tau_pos: float = 1.0
    """SAPO gate temperature for positive advantages (> 0)."""

    sapo_tau_neg: float = 1.05
    """SAPO gate temperature for negative advantages (> 0)."""

    use_cispo_loss: bool = False
    """CISPO: stop-gradient clipped importance weight × advantage × log π_θ on every token;
    needs `eps_clip_higher` (AReaL's spelling of `surrogate: cispo`; kept equal to it)."""

    recompute_logprob: bool = False
    """Recompute log-probabilities with the trainer's weights before the update (π_prox)."""

    use_decoupled_loss: bool = False
    """Decoupled PPO: clip π_θ/π_prox and weight by π_prox/π_behave (see
    `decoupled_correction`); implies a π_prox from `prox_logp_method`."""

    decoupled_correction: Literal["behave_imp_weight", "none"] = "behave_imp_weight"
    """Flywheel: with the decoupled loss, multiply each token's loss by π_prox/π_behave
    (`behave_imp_weight`). `none` drops it and must be chosen explicitly (an ablation):
    Flywheel never drops it on its own."""

    rejection_sampling: RejectionSamplingConfig | None = None
    """Filtering/truncation of stale tokens by π_prox vs π_behave; null disables.
    Replaces AReaL's removed `behave_imp_weight_cap`/`behave_imp_weight_mode`."""

    importance_sampling_level: Literal["token", "sequence"] = "token"
    """Per-token ratios (PPO) or one geometric-mean ratio per sequence (GSPO)."""

    prox_logp_method: ProxLogpMethod = "recompute"
    """How π_prox is obtained with the decoupled loss: a forward pass (`recompute`),
    version-aware interpolation (`loglinear`, `linear`), both with error stats
    (`metrics`), or the training forward itself (`reuse_train_logp`, one minibatch)."""

    loss_agg_mode: LossAggMode = "token-mean"
    """Flywheel: how token losses become one number: mean over all tokens of the batch
    (AReaL), mean of per-sequence means, or per-sequence sums divided by a constant
    (`loss_agg_norm`, Dr.GRPO)."""

    loss_agg_norm: float | None = Field(default=None, gt=0.0)
    """Flywheel: the constant divisor of `seq-mean-token-sum-norm`; null uses
    `max_new_tokens`."""

    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal (variable batch size)."""

    should_accept_fn: str | None = None
    """Flywheel: dotted path of `fn(group) -> bool` deciding which groups are kept
    (`dapo_equal_rewards` is built in); null keeps every group."""

    log_agent_stats: bool = False
    """Log per-agent statistics of multi-turn trajectories."""

    log_agent_stats_keys: list[str] = Field(default_factory=list)
    """Metadata keys logged when `log_agent_stats` is on."""

    max_new_tokens: int = Field(default=1024, ge=1)
    """Generation length limit as the trainer sees it (overlong penalty, Dr.GRPO norm)."""

    freeze_vision_tower: bool = False
    """Flywheel (verl's name; AReaL has none): keep a vision-language model's vision tower
    (`model.visual` of Qwen2-VL / Qwen2.5-VL) at its checkpoint weights. Its gradients are
    off, and weight updates leave its tensors out (every replica already serves them).
    False trains the whole model and sends the tower with every update. No effect on a
    text model."""

    legacy_keys: ClassVar[dict[str, str]] = {
        "behave_imp_weight_cap": REJECTION_SAMPLING_MIGRATION,
        "behav_imp_weight_cap": REJECTION_SAMPLING_MIGRATION,
        "behave_imp_weight_mode": REJECTION_SAMPLING_MIGRATION,
        "group_adv_norm": (
            "removed in AReaL; write `adv_norm: {mean_level: group, std_level: group}` "
            "for true, or leave adv_norm at batch level for false"
        ),
        "group_reward_norm": (
            "removed in AReaL; write `reward_norm: {mean_level: group, std_level: group}` "
            "for true, or `reward_norm: null` for false"
        ),
    }

    @model_validator(mode="before")
    @classmethod
    def _reject_legacy(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, migration in cls.legacy_keys.items():
                if key in data:
                    raise RuleViolation(key, data[key], migration)
        return data

    @field_validator("surrogate", mode="before")
    @classmethod
    def _surrogate(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            if text in BUILTIN_SURROGATES or _DOTTED_PATH.fullmatch(text):
                return text
        raise RuleViolation(
            "surrogate",
            value,
            f"must be one of {', '.join(BUILTIN_SURROGATES)} or the dotted path "
            "'package.module:function' of a services.api.Surrogate",
        )

    @field_validator("gae_lambda", mode="before")
    @classmethod
    def _gae_lambda(cls, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise RuleViolation(
                "gae_lambda",
                value,
                "must be a number in [0, 1] or the dotted path of a λ function",
            )
        if isinstance(value, str):
            text = value.strip()
            try:
                return float(text)
            except ValueError:
                pass
            if not text:
                raise RuleViolation("gae_lambda", value, "the λ function path is empty")
            return text
        if not 0.0 <= float(value) <= 1.0:
            raise RuleViolation("gae_lambda", value, "a numeric λ must be in [0, 1]")
        return float(value)

    @model_validator(mode="after")
    def _rules(self) -> PPOActorConfig:
        self._resolve_surrogate()
        self._check_clipping()
        self._check_surrogates()
        self._check_decoupled()
        self._check_rewards_and_advantages()
        return self

    def _check_clipping(self) -> None:
        if self.eps_clip_higher is not None and self.eps_clip_higher <= 0:
            raise RuleViolation(
                "eps_clip_higher", self.eps_clip_higher, "must be > 0, or null for symmetric clip"
            )
        if self.c_clip is not None and self.c_clip <= 1.0:
            raise RuleViolation(
                "c_clip",
                self.c_clip,
                "the dual-clip bound must be > 1 (it caps the loss of negative advantages "
                "at c_clip × advantage); typical value 3, or null to disable",
            )
        if self.m2_threshold is not None and self.m2_threshold <= 0:
            raise RuleViolation(
                "m2_threshold",
                self.m2_threshold,
                "must be > 0 (e.g. 0.04), or null to disable M2PO",
            )

    def _resolve_surrogate(self) -> None:
        """`use_sapo_loss` / `use_cispo_loss` (AReaL) → `surrogate`, and back, so the two
        spellings always agree in the resolved config. A boolean set true contradicts any
        other surrogate given explicitly (a dump of the resolved config has both, equal)."""
        flags = [n for n in ("sapo", "cispo") if getattr(self, f"use_{n}_loss")]
        if len(flags) == 2:
            raise RuleViolation(
                "use_cispo_loss",
                True,
                "CISPO and SAPO are alternative surrogates; enable at most one of "
                "use_cispo_loss / use_sapo_loss (or write surrogate: sapo | cispo)",
            )
        if flags:
            if "surrogate" in self.model_fields_set and self.surrogate != flags[0]:
                raise RuleViolation(
                    "surrogate",
                    self.surrogate,
                    f"contradicts use_{flags[0]}_loss: true; set surrogate: {flags[0]}, or "
                    f"use_{flags[0]}_loss: false to keep surrogate: {self.surrogate}",
                )
            self.__dict__["surrogate"] = flags[0]
        self.__dict__["use_sapo_loss"] = self.surrogate == "sapo"
        self.__dict__["use_cispo_loss"] = self.surrogate == "cispo"

    def _check_surrogates(self) -> None:
        if self.surrogate == "sapo":
            for name in ("sapo_tau_pos", "sapo_tau_neg"):
                tau = getattr(self, name)
                if not tau > 0:
                    raise RuleViolation(
                        name, tau, "SAPO gate temperatures must be > 0 (defaults 1.0 and 1.05)"
                    )
            if self.use_decoupled_loss:
                raise RuleViolation(
                    "use_sapo_loss",
                    True,
                    "SAPO cannot be combined with use_decoupled_loss=true (its soft gate has "
                    "no proximal policy); set use_decoupled_loss: false",
                )
        if self.surrogate == "cispo":
            if self.eps_clip_higher is None:
                raise RuleViolation(
                    "eps_clip_higher",
                    None,
                    "CISPO needs an upper clip of its importance weight; set eps_clip_higher "
                    "(e.g. eps_clip: 1.0, eps_clip_higher: 4.0)",
                )
            if self.importance_sampling_level != "token":
                raise RuleViolation(
                    "importance_sampling_level",
                    self.importance_sampling_level,
                    "CISPO is defined per token only; set importance_sampling_level: token",
                )

    def _check_decoupled(self) -> None:
        if self.prox_logp_method == "reuse_train_logp" and self.ppo_n_minibatches > 1:
            raise RuleViolation(
                "ppo_n_minibatches",
                self.ppo_n_minibatches,
                "prox_logp_method 'reuse_train_logp' reuses the first training forward as "
                "π_prox, which is only the pre-update policy with one minibatch; set "
                "ppo_n_minibatches: 1 or choose prox_logp_method: recompute",
            )
        if not self.use_decoupled_loss:
            if self.rejection_sampling is not None:
                raise RuleViolation(
                    "rejection_sampling",
                    self.rejection_sampling.model_dump(),
                    "acts on π_prox/π_behave, which exists only with the decoupled loss; "
                    "set use_decoupled_loss: true or rejection_sampling: null",
                )
            if self.prox_logp_method != "recompute":
                raise RuleViolation(
                    "prox_logp_method",
                    self.prox_logp_method,
                    "only applies with use_decoupled_loss: true; enable it or leave the "
                    "method at 'recompute'",
                )
            if self.decoupled_correction != "behave_imp_weight":
                raise RuleViolation(
                    "decoupled_correction",
                    self.decoupled_correction,
                    "only applies with use_decoupled_loss: true",
                )
        elif self.prox_logp_method in ("recompute", "metrics") and not self.recompute_logprob:
            # AReaL turns this on implicitly; Flywheel writes it into the resolved
            # config so `--dry-run` shows where π_prox comes from.
            self.__dict__["recompute_logprob"] = True

    def _check_rewards_and_advantages(self) -> None:
        if self.mask_no_eos_with_zero and self.overlong_filtering:
            raise RuleViolation(
                "overlong_filtering",
                True,
                "already removes truncated completions from training, so "
                "mask_no_eos_with_zero (which zeroes their reward and keeps them in the loss) "
                "would do nothing; set one of the two",
            )
        if self.overlong_reward_penalty:
            if self.overlong_tokens is None or self.overlong_penalty_factor is None:
                raise RuleViolation(
                    "overlong_reward_penalty",
                    True,
                    "needs overlong_tokens (tail length) and overlong_penalty_factor "
                    "(largest penalty), e.g. 256 and 1.0",
                )
            if self.overlong_tokens > self.max_new_tokens:
                raise RuleViolation(
                    "overlong_tokens",
                    self.overlong_tokens,
                    f"the penalised tail is longer than max_new_tokens={self.max_new_tokens}; "
                    "use a value <= max_new_tokens",
                )
        if self.loss_agg_norm is not None and self.loss_agg_mode != "seq-mean-token-sum-norm":
            raise RuleViolation(
                "loss_agg_norm",
                self.loss_agg_norm,
                "is only used by loss_agg_mode 'seq-mean-token-sum-norm' "
                f"(got '{self.loss_agg_mode}'); remove it or change the mode",
            )
        if isinstance(self.gae_lambda, float) and self.gae_lambda_kwargs:
            raise RuleViolation(
                "gae_lambda_kwargs",
                self.gae_lambda_kwargs,
                "are arguments of a λ function, but gae_lambda is the number "
                f"{self.gae_lambda}; set gae_lambda to a function path or drop the kwargs",
            )
        groupwise = any(
            n is not None and n.uses_group_statistics for n in (self.reward_norm, self.adv_norm)
        )
        if self.min_usable_group_size is not None and self.min_usable_group_size < 2 and groupwise:
            raise RuleViolation(
                "min_usable_group_size",
                self.min_usable_group_size,
                "a group-level normalisation needs at least 2 samples per group; use >= 2 "
                "or leave it null",
            )


class PPOCriticConfig(TrainEngineConfig):
    """The value model of PPO (with GAE); absent for critic-free methods like GRPO."""

    is_critic: bool = True
    """A value head instead of the LM head (Flywheel: true by default in this block)."""

    ppo_n_minibatches: int = Field(default=4, ge=1)
    """Value-update steps per training batch."""

    eps_clip: float = Field(default=0.5, gt=0.0)
    """Value clipping: new values are kept within ±eps_clip of the old ones."""

    mask_no_eos_with_zero: bool = False
    """Accepted for AReaL configs and has no effect, as in AReaL (whose critic only logs
    it): the critic trains on the actor's loss mask, so the actor's `overlong_filtering`
    takes truncated completions out of the value loss too."""

    value_loss: Literal["mse", "huber"] = "mse"
    """Flywheel: value loss, squared error (AReaL) or Huber."""

    huber_delta: float = Field(default=10.0, gt=0.0)
    """Flywheel: Huber transition point (only with `value_loss: huber`); 10 is the δ
    AReaL's `ppo_critic_loss_fn` uses for its Huber loss."""


class TeacherConfig(TrainEngineConfig):
    """On-policy distillation: a teacher model whose log-probabilities the actor's loss
    pulls towards (AReaL 2.0's `TeacherConfig` and the teacher term of its actor loss).

    The trainer loads the teacher like the reference model and scores every batch with
    it (AReaL's `engine_type: train`). The loss gains
    `distill_loss_weight · mean(log π_θ - log π_teacher)` and the RL loss is multiplied by
    `rl_loss_weight`; with `rl_loss_weight: 0` the RL loss is dropped and the loss is the
    importance-weighted reverse KL alone (see docs/algorithms.md). AReaL's nested form
    `train: {path: ..., ...}` is accepted: its engine fields fill this block. The teacher
    scores under its own `temperature` (default 1.0), as AReaL's teacher engine does.
    """

    engine_type: Literal["train", "rollout"] = "train"
    """How teacher log-probabilities are computed: `train` (a forward pass in the
    trainer, like `ref`). AReaL's `rollout` (scoring on an inference server) is not
    implemented. Flywheel: defaults to `train` (AReaL: `rollout`)."""

    rl_loss_weight: float = Field(default=1.0, ge=0.0)
    """Weight of the RL (PPO-family) loss; 0 trains on the distillation term alone."""

    distill_loss_weight: float = Field(default=0.005, ge=0.0)
    """Weight of the distillation (reverse KL to the teacher) term."""

    # AReaL refuses its removed importance-weight cap in the teacher block as in the actor's.
    legacy_keys: ClassVar[dict[str, str]] = {
        key: REJECTION_SAMPLING_MIGRATION
        for key in ("behave_imp_weight_cap", "behav_imp_weight_cap", "behave_imp_weight_mode")
    }

    @model_validator(mode="before")
    @classmethod
    def _areal_nesting(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("rollout") is not None or data.get("engine_type") == "rollout":
            raise RuleViolation(
                "engine_type",
                data.get("engine_type", "rollout"),
                "Flywheel computes teacher log-probabilities in the trainer; set "
                "engine_type: train, remove `rollout` and give the checkpoint as path",
            )
        data.pop("rollout", None)
        train = data.pop("train", None)
        if isinstance(train, dict):
            for key, migration in cls.legacy_keys.items():
                if key in train:
                    raise RuleViolation(f"train.{key}", train[key], migration)
            engine_fields = set(TrainEngineConfig.model_fields)
            loss_only = set(PPOActorConfig.model_fields) - engine_fields
            for key, value in train.items():
                if key in loss_only:
                    continue  # the teacher is never trained: its loss settings mean nothing
                if key == "path" and data.get("path"):
                    continue  # AReaL: teacher.path overrides
                data.setdefault(key, value)
        return data

    @model_validator(mode="after")
    def _teacher_rules(self) -> TeacherConfig:
        if self.optimizer is not None:
            raise RuleViolation(
                "optimizer", "set", "the teacher is never trained; remove its optimizer"
            )
        if self.rl_loss_weight == 0 and self.distill_loss_weight == 0:
            raise RuleViolation(
                "distill_loss_weight",
                0.0,
                "with rl_loss_weight: 0 too the loss is 0; set one of them > 0",
            )
        return self
