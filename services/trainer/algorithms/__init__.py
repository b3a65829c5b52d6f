"""Flywheel's algorithm core: pure tensor functions for the PPO family.

No I/O and no process groups (the one exception: batch-level normalisation all-reduces its
sums when given a `process_group`). Formulas, presets and the statistics table are in
`docs/algorithms.md`. The public API:

Advantages
    `compute_advantages(...) -> AdvantageResult` — rewards → overlong penalty, bias /
    scaling / clip, `reward_norm`, KL shaping (k1/k2/k3 against a reference), GAE over
    tokens or turns with per-trajectory λ, `adv_norm`.
    `normalize(...)`, `normalize_with(x, NormConfig, ...)`, `NormSpec`.
Losses
    `ppo_actor_loss(...) -> (loss, stats)` — clip / dual clip / clip-higher, token or
    sequence (GSPO) ratios, decoupled PPO, SAPO, CISPO, M2PO, rejection sampling
    (IcePop / KPop); `critic_loss(...) -> (loss, stats)`; `aggregate_loss(...)`.
Proximal policy
    `compute_prox_logp(method, ...) -> ProxResult`, `needs_recompute(method)`.
Filters (torch-free)
    `services.trainer.algorithms.filters`: `FILTERS`, `resolve_should_accept`.
Config adapters
    `advantages_from_config`, `actor_loss_from_config`, `critic_loss_from_config`,
    `prox_from_config`, `should_accept_from_config`, and the `*_kwargs` helpers.
Registries (`Registry`: unknown names list the valid ones, duplicates are errors)
    `SURROGATES`, `KL_ESTIMATORS`, `GAE_LAMBDA_FNS`, `AGGREGATORS`, `FILTERS`.
Statistics
    `STATS`: every statistic name with its meaning.

Names are loaded lazily (PEP 562) so that `import services.trainer.algorithms.filters`
does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    # advantages
    "AdvantageResult": "advantages",
    "compute_advantages": "advantages",
    "normalize": "normalization",
    "normalize_with": "normalization",
    "NormSpec": "normalization",
    "group_index_from_ids": "normalization",
    "gae_token_level": "gae",
    "gae_turn_level": "gae",
    "GAE_LAMBDA_FNS": "gae_lambda",
    "resolve_gae_lambda": "gae_lambda",
    "overlong_penalty": "rewards",
    "shape_rewards": "rewards",
    "KL_ESTIMATORS": "kl",
    "binary_kl_symmetric": "kl",
    # losses
    "ppo_actor_loss": "losses",
    "critic_loss": "losses",
    "aggregate_loss": "aggregation",
    "AGGREGATORS": "aggregation",
    "SURROGATES": "surrogates",
    "SurrogateParams": "surrogates",
    "apply_rejection_sampling": "offpolicy",
    "m2po_mask": "offpolicy",
    "RejectionSpec": "offpolicy",
    "ICEPOP": "offpolicy",
    "KPOP": "offpolicy",
    # proximal policy
    "compute_prox_logp": "prox",
    "needs_recompute": "prox",
    "interpolation_alpha": "prox",
    "ProxResult": "prox",
    "PROX_LOGP_METHODS": "prox",
    # filters
    "FILTERS": "filters",
    "resolve_should_accept": "filters",
    "filter_groups": "filters",
    # config adapters
    "advantages_from_config": "config_adapters",
    "actor_loss_from_config": "config_adapters",
    "critic_loss_from_config": "config_adapters",
    "prox_from_config": "config_adapters",
    "should_accept_from_config": "config_adapters",
    "advantage_kwargs": "config_adapters",
    "actor_loss_kwargs": "config_adapters",
    "critic_loss_kwargs": "config_adapters",
    # layouts, registries, stats
    "packed_to_padded": "layout",
    "padded_to_packed": "layout",
    "Registry": "registry",
    "RegistryError": "registry",
    "STATS": "stats",
}

__all__ = [
    "AGGREGATORS",
    "AdvantageResult",
    "FILTERS",
    "GAE_LAMBDA_FNS",
    "ICEPOP",
    "KL_ESTIMATORS",
    "KPOP",
    "NormSpec",
    "PROX_LOGP_METHODS",
    "ProxResult",
    "Registry",
    "RegistryError",
    "RejectionSpec",
    "STATS",
    "SURROGATES",
    "SurrogateParams",
    "actor_loss_from_config",
    "actor_loss_kwargs",
    "advantage_kwargs",
    "advantages_from_config",
    "aggregate_loss",
    "apply_rejection_sampling",
    "binary_kl_symmetric",
    "compute_advantages",
    "compute_prox_logp",
    "critic_loss",
    "critic_loss_from_config",
    "critic_loss_kwargs",
    "filter_groups",
    "gae_token_level",
    "gae_turn_level",
    "group_index_from_ids",
    "interpolation_alpha",
    "m2po_mask",
    "needs_recompute",
    "normalize",
    "normalize_with",
    "overlong_penalty",
    "packed_to_padded",
    "padded_to_packed",
    "ppo_actor_loss",
    "prox_from_config",
    "resolve_gae_lambda",
    "resolve_should_accept",
    "shape_rewards",
    "should_accept_from_config",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # pragma: no cover - static analysers see the real names
    from .advantages import AdvantageResult, compute_advantages
    from .aggregation import AGGREGATORS, aggregate_loss
    from .config_adapters import (
        actor_loss_from_config,
        actor_loss_kwargs,
        advantage_kwargs,
        advantages_from_config,
        critic_loss_from_config,
        critic_loss_kwargs,
        prox_from_config,
        should_accept_from_config,
    )
    from .filters import FILTERS, filter_groups, resolve_should_accept
    from .gae import gae_token_level, gae_turn_level
    from .gae_lambda import GAE_LAMBDA_FNS, resolve_gae_lambda
    from .kl import KL_ESTIMATORS, binary_kl_symmetric
    from .layout import packed_to_padded, padded_to_packed
    from .losses import critic_loss, ppo_actor_loss
    from .normalization import NormSpec, group_index_from_ids, normalize, normalize_with
    from .offpolicy import ICEPOP, KPOP, RejectionSpec, apply_rejection_sampling, m2po_mask
    from .prox import (
        PROX_LOGP_METHODS,
        ProxResult,
        compute_prox_logp,
        interpolation_alpha,
        needs_recompute,
    )
    from .registry import Registry, RegistryError
    from .rewards import overlong_penalty, shape_rewards
    from .stats import STATS
    from .surrogates import SURROGATES, SurrogateParams
