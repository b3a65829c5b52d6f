"""Flywheel's algorithm core: pure tensor functions for the PPO family.

No I/O and no process groups (the one exception: batch-level normalisation all-reduces its
sums when given a `process_group`). Formulas, presets and the statistics table are in
`docs/algorithms.md`.

Every function takes tensors and, where it has settings, one frozen view of the config
built once at load (`services.common.config.views`: `AdvantageView`, `ActorLossView`,
`CriticLossView`); the schema validated the values and owns their defaults.

The trainer's entry points (`api.py`): `PPOTrainer` calls these and nothing else for its
algorithm steps, so a script that calls them gets the trainer's numbers.

    `batch_advantages(settings, batch, prox_logprobs=, ref_logprobs=, values=, ...)
        -> AdvantageResult` — advantages, returns and loss mask of a padded batch; the KL
        reward's π_old chosen by `kl_logprobs` (AReaL's rule).
    `actor_loss(settings, logprobs, advantages, loss_mask, behave_logprobs=,
        prox_logp_method=, recomputed_logprobs=, versions=, current_version=,
        teacher_logprobs=, normalizer=, ...) -> (loss, stats)` — π_prox by the chosen
        method, then the PPO-family loss.
    `gae_lambda_context(loss_mask, turn_ids, gae_timestep_unit)` — the λ-function context.
    `approximate_prox_logp(method, behave, theta, alpha)` with `interpolation_alpha` —
        each proximal approximation: `loglinear`, `linear`, `rollout`.

The functions under them:

Advantages
    `compute_advantages(settings, rewards=, loss_mask=, no_eos=, ...) -> AdvantageResult`
    — rewards → overlong penalty, bias /
    scaling / clip, `reward_norm`, KL shaping (k1/k2/k3 against a reference), GAE over
    tokens or turns with per-trajectory λ, `adv_norm`.
    `normalize(...)`, `normalize_with(x, NormConfig, ...)`.
Losses
    `ppo_actor_loss(logprobs, proximal_logprobs, advantages, loss_mask, settings, ...)
    -> (loss, stats)` — clip / dual clip / clip-higher, token or
    sequence (GSPO) ratios, decoupled PPO, SAPO, CISPO, M2PO, rejection sampling
    (IcePop / KPop), the on-policy distillation term; `critic_loss(values, old_values,
    returns, loss_mask, settings, ...) -> (loss, stats)`;
    `aggregate_loss(...)`. Their stats hold AReaL's per-token tensors.
Proximal policy
    `compute_prox_logp(method, ...) -> ProxResult` (every method of `PROX_LOGP_METHODS`),
    `needs_recompute(method)`.
Filters
    The group filters live in `services.core.filters` (torch-free, shared with the buffer).
Registries (`services.core.plugins.Registry`: unknown names list the valid ones,
duplicates are errors)
    `SURROGATES`, `KL_ESTIMATORS`, `GAE_LAMBDA_FNS`, `AGGREGATORS`.
Statistics
    `STATS`: every scalar and reported name with its meaning; `ACTOR_TOKEN_STATS` /
    `CRITIC_TOKEN_STATS`: which per-token tensor over which mask becomes
    `<name>/avg|min|max`; `summarize_token_stats(stats, table)` reduces one call's.
"""

from .advantages import AdvantageResult, compute_advantages
from .aggregation import AGGREGATORS, aggregate_loss
from .api import actor_loss, batch_advantages, kl_logprobs
from .gae import gae_token_level, gae_turn_level
from .gae_lambda import GAE_LAMBDA_FNS, gae_lambda_context, resolve_gae_lambda
from .kl import KL_ESTIMATORS, binary_kl_symmetric
from .layout import packed_to_padded, padded_to_packed
from .losses import critic_loss, ppo_actor_loss
from .normalization import group_index_from_ids, normalize, normalize_with
from .offpolicy import apply_rejection_sampling, behave_imp_weight, m2po_mask
from .prox import (
    PROX_LOGP_METHODS,
    ProxResult,
    approximate_prox_logp,
    compute_prox_logp,
    interpolation_alpha,
    needs_recompute,
)
from .rewards import overlong_penalty, shape_rewards
from .stats import (
    ACTOR_TOKEN_STATS,
    CRITIC_TOKEN_STATS,
    PROX_APPROX_METHODS,
    STATS,
    TokenStat,
    summarize_token_stats,
    token_reductions,
)
from .surrogates import SURROGATES, SurrogateParams

__all__ = [
    "ACTOR_TOKEN_STATS",
    "AGGREGATORS",
    "AdvantageResult",
    "CRITIC_TOKEN_STATS",
    "GAE_LAMBDA_FNS",
    "KL_ESTIMATORS",
    "PROX_APPROX_METHODS",
    "PROX_LOGP_METHODS",
    "ProxResult",
    "STATS",
    "SURROGATES",
    "SurrogateParams",
    "TokenStat",
    "actor_loss",
    "aggregate_loss",
    "apply_rejection_sampling",
    "approximate_prox_logp",
    "batch_advantages",
    "behave_imp_weight",
    "binary_kl_symmetric",
    "compute_advantages",
    "compute_prox_logp",
    "critic_loss",
    "gae_lambda_context",
    "gae_token_level",
    "gae_turn_level",
    "group_index_from_ids",
    "interpolation_alpha",
    "kl_logprobs",
    "m2po_mask",
    "needs_recompute",
    "normalize",
    "normalize_with",
    "overlong_penalty",
    "packed_to_padded",
    "padded_to_packed",
    "ppo_actor_loss",
    "resolve_gae_lambda",
    "shape_rewards",
    "summarize_token_stats",
    "token_reductions",
]
