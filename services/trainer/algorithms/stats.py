"""Training-health statistics: every name in one table, and the masked reductions.

Two kinds, as in AReaL:

* scalars: 0-d float tensors whose keys are listed in `STATS` (counts, fractions, the
  aggregated loss). Means are over the valid tokens (or sequences) of the call;
  `n_valid_tokens` and `n_seqs` come with them so the trainer can weight statistics of
  several micro-batches or ranks correctly.
* per-token statistics: the losses return AReaL's per-token tensors (`importance_weight`,
  `approx_kl`, `clip_mask`, `dual_clip_mask`, `behave_imp_weight`, `behave_mask`, ...)
  and the masks they are taken over. `ACTOR_TOKEN_STATS` / `CRITIC_TOKEN_STATS` say which
  tensor over which mask becomes which reported name; `token_reductions` is the one place
  that turns them into `<name>/avg`, `<name>/min`, `<name>/max` (AReaL's export names).

A test checks that no function emits an undocumented name, and `docs/algorithms.md`
renders the same table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

PROX_APPROX_METHODS: tuple[str, ...] = ("loglinear", "linear", "rollout")
PROX_ERROR_QUANTITIES: tuple[str, ...] = ("logp", "behave_imp_weight", "importance_weight")
PROX_ERROR_KINDS: tuple[str, ...] = ("abs_error", "rel_error", "sq_error")

# name -> (what it is, what a bad trend means). Rendered in docs/algorithms.md.
STATS: dict[str, tuple[str, str]] = {
    # -- batch and rewards (compute_advantages) --------------------------------------------
    "n_seqs": ("sequences in the call", "—"),
    "n_valid_tokens": (
        "tokens with loss_mask = 1 after every filter",
        "drops: filters eat the batch",
    ),
    "task_reward": ("mean raw outcome reward per sequence", "flat: nothing is learnt"),
    "correct_n_seqs": ("sequences with reward > 0", "—"),
    "incorrect_n_seqs": ("sequences with reward <= 0", "—"),
    "no_eos_ratio": (
        "fraction of sequences truncated (the trajectory's no_eos flag)",
        "rises: completions run into max_new_tokens",
    ),
    "response_len": ("mean generated tokens per sequence", "explodes or collapses: reward hacking"),
    "seq_len": ("mean prompt + completion tokens (needs attention_mask)", "—"),
    "prompt_len": ("mean prompt tokens (needs attention_mask)", "—"),
    "overlong_penalty": ("mean DAPO overlong penalty per sequence (<= 0)", "large: too long"),
    "shaped_reward": (
        "mean per-sequence outcome reward after overlong penalty, bias, scaling, clip, "
        "reward_norm and the truncation options (mask_no_eos_with_zero, overlong_filtering)",
        "—",
    ),
    "kl_rewards": (
        "mean per-token KL reward -kl_ctl * KL(pi_old ‖ pi_ref)",
        "grows negative: the policy drifts from the reference",
    ),
    "advantages": ("mean advantage over valid tokens (after adv_norm)", "—"),
    "advantages_abs": ("mean absolute advantage over valid tokens", "near 0: no learning signal"),
    "returns": ("mean critic target (advantage + value) over valid tokens", "—"),
    "gae_lambda": ("mean GAE lambda over sequences", "—"),
    # -- actor loss (ppo_actor_loss); per-token statistics are in TOKEN_STATS --------------
    "actor_loss": ("aggregated actor loss (detached)", "—"),
    "n_total_tokens": (
        "token positions the actor loss saw, prompt and completion (padding excluded)",
        "—",
    ),
    "n_masked_tokens": (
        "n_total_tokens - n_valid_tokens: positions without a loss (prompt, tool output, "
        "removed sequences, M2PO; rejection sampling is not counted)",
        "—",
    ),
    "masked_token_ratio": (
        "n_masked_tokens / n_total_tokens (1 - n_valid_tokens / max(n_total_tokens, 1))",
        "rises: the batch is mostly prompt, or filters and M2PO remove the completions",
    ),
    "rs_filtered_fraction": (
        "fraction of valid tokens masked (mask) or clamped (clamp) by rejection sampling",
        "high: too much stale data is thrown away",
    ),
    "m2po_masked_fraction": ("fraction of valid tokens masked by M2PO", "high: very stale data"),
    "m2po_second_moment": ("mean (log pi_prox/pi_behave)^2 before M2PO masking", "—"),
    "staleness_avg": (
        "mean over generated tokens of current_version - v_behave",
        "above max_head_offpolicyness: admission is broken",
    ),
    "staleness_min": ("min over generated tokens of current_version - v_behave", "—"),
    "staleness_max": ("max over generated tokens of current_version - v_behave", "—"),
    # -- proximal log-probability (compute_prox_logp) ---------------------------------------
    "prox_alpha": (
        "mean interpolation weight alpha over generated tokens (loglinear/linear/metrics)",
        "—",
    ),
    # -- critic (critic_loss); per-token statistics are in TOKEN_STATS ---------------------
    "value_loss": ("aggregated critic loss (detached)", "does not fall: critic does not learn"),
    # -- dynamic filtering (filters.filter_groups) -----------------------------------------
    "dynamic_filter_dropped_fraction": (
        "fraction of groups dropped by should_accept",
        "near 1: prompts are too easy or too hard",
    ),
}

for _m in PROX_APPROX_METHODS:
    for _q in PROX_ERROR_QUANTITIES:
        for _k in PROX_ERROR_KINDS:
            STATS[f"prox_approx/{_m}/{_q}_{_k}"] = (
                f"{_k.replace('_', ' ')} of the {_m} approximation of {_q} against the "
                "recomputed pi_prox (metrics mode), mean over generated tokens",
                "grows: the approximation no longer tracks pi_prox",
            )


@dataclass(frozen=True)
class TokenStat:
    """A per-token statistic: `values` and `mask` name tensors in a loss's stats dict.

    The trainer reports it as `<name>/avg`, `<name>/min` and `<name>/max` over the tokens
    where `mask` is true (AReaL's `stats_tracker.stat(..., denominator=...)`, which exports
    the same three), summed over every micro-batch and rank of the step before dividing.
    """

    values: str
    mask: str
    what: str
    bad: str = "—"


# AReaL's names (areal/trainer/ppo/actor.py `grpo_loss_fn`): reported name -> where it comes
# from in the stats of `ppo_actor_loss`. `loss_mask` there is AReaL's `n_valid_tokens`
# denominator: the loss mask after M2PO and before rejection sampling.
ACTOR_TOKEN_STATS: dict[str, TokenStat] = {
    "importance_weight": TokenStat(
        "importance_weight",
        "loss_mask",
        "ratio pi_theta/pi_prox (GSPO: the sequence ratio; 0 on tokens rejection sampling dropped)",
        "far from 1: the update moves too far per minibatch",
    ),
    "approx_kl": TokenStat(
        "approx_kl", "loss_mask", "log pi_theta - log pi_prox", "grows: step size too large"
    ),
    "clip_ratio": TokenStat(
        "clip_mask", "loss_mask", "1 where the clip binds, else 0", "high: lr or eps too tight"
    ),
    "dual_clip_ratio": TokenStat("dual_clip_mask", "loss_mask", "1 where the dual clip binds"),
    "actor_loss": TokenStat("loss", "loss_mask", "per-token surrogate loss (x behaviour weight)"),
    "entropy": TokenStat(
        "entropy", "loss_mask", "token entropy of pi_theta", "collapses: no exploration"
    ),
    "behave_imp_weight": TokenStat(
        "behave_imp_weight",
        "behave_mask",
        "pi_prox/pi_behave over the tokens the behaviour weight keeps (decoupled loss)",
        "far from 1: rollouts are stale or engine and trainer disagree",
    ),
    "behave_approx_kl": TokenStat(
        "behave_approx_kl",
        "behave_mask",
        "log pi_prox - log pi_behave over the kept tokens",
        "grows: staleness or an inference/training mismatch",
    ),
    "behave_filtered_ratio": TokenStat(
        "behave_filtered_mask",
        "loss_mask",
        "1 where rejection sampling dropped the token (or its weight is 0), else 0",
        "high: too much stale data is thrown away",
    ),
    "sapo_soft_gate": TokenStat("sapo_soft_gate", "loss_mask", "SAPO gate of the token's sign"),
    "sapo_scaled_gate_pos": TokenStat(
        "sapo_scaled_gate_pos", "loss_mask", "SAPO gate (4/tau_pos) sigmoid(tau_pos (r - 1))"
    ),
    "sapo_scaled_gate_neg": TokenStat(
        "sapo_scaled_gate_neg", "loss_mask", "SAPO gate (4/tau_neg) sigmoid(tau_neg (r - 1))"
    ),
    "rkl_loss": TokenStat(
        "rkl_loss",
        "loss_mask",
        "on-policy distillation term per token: log pi_theta - log pi_teacher (with the RL "
        "loss), or -w (log pi_teacher - log pi_theta), w = pi_theta/pi_old (distillation only)",
        "grows: the student drifts from the teacher",
    ),
}

# AReaL's critic statistics (areal/trainer/ppo/critic.py `ppo_loss_fn`, scope ppo_critic),
# prefixed so they do not collide with the actor's.
CRITIC_TOKEN_STATS: dict[str, TokenStat] = {
    "critic_loss": TokenStat("loss", "loss_mask", "per-token clipped value loss"),
    "value_clip_ratio": TokenStat(
        "clip_mask", "loss_mask", "1 where value clipping binds, else 0", "high: eps too small"
    ),
    "new_value": TokenStat("new_value", "loss_mask", "predicted value"),
    "old_value": TokenStat("old_value", "loss_mask", "value before the update"),
    "target_value": TokenStat("target_value", "loss_mask", "critic target (GAE return)"),
}

TOKEN_STAT_REDUCTIONS: tuple[str, ...] = ("avg", "min", "max")

for _table in (ACTOR_TOKEN_STATS, CRITIC_TOKEN_STATS):
    for _name, _ts in _table.items():
        for _r in TOKEN_STAT_REDUCTIONS:
            STATS[f"{_name}/{_r}"] = (f"{_r} over tokens of: {_ts.what}", _ts.bad)


@dataclass
class TokenReduction:
    """Sum, count, min and max of one per-token statistic over its mask (0-d tensors on the
    values' device; min/max are +inf/-inf when the mask is empty)."""

    total: Tensor  # float64
    count: Tensor  # int64
    min: Tensor  # float32, +inf when count is 0
    max: Tensor  # float32, -inf when count is 0


def token_reductions(
    stats: dict[str, Tensor], table: dict[str, TokenStat]
) -> dict[str, TokenReduction]:
    """The one place per-token statistics become numbers: for every entry of `table`
    whose tensors are in `stats`, the sum, count, min and max over its mask.

    `behave_filtered_mask` is derived here (AReaL: `loss_mask & ~behave_mask`, where the
    behaviour mask is taken after rejection sampling) when the loss gave `behave_mask`.
    """
    out: dict[str, TokenReduction] = {}
    for name, ts in table.items():
        if ts.values == "behave_filtered_mask" and "behave_mask" in stats:
            values: Tensor | None = stats[ts.mask] & ~stats["behave_mask"]
        else:
            values = stats.get(ts.values)
        mask = stats.get(ts.mask)
        if values is None or mask is None or values.dim() == 0:
            continue
        m = mask.to(torch.bool)
        v = values.detach()
        if v.dtype == torch.bool:
            v = v.to(torch.float32)
        v32 = v.to(torch.float32)
        total = torch.where(m, v32, 0.0).sum(dtype=torch.float64)
        lo = (
            torch.where(m, v32, math.inf).amin()
            if v.numel()
            else torch.tensor(math.inf, device=v.device)
        )
        hi = (
            torch.where(m, v32, -math.inf).amax()
            if v.numel()
            else torch.tensor(-math.inf, device=v.device)
        )
        out[name] = TokenReduction(total, m.sum(), lo, hi)  # no host sync
    return out


def summarize_token_stats(
    stats: dict[str, Tensor], table: dict[str, TokenStat]
) -> dict[str, Tensor]:
    """`<name>/avg`, `/min`, `/max` of one call's per-token statistics (0-d float32), what
    the trainer reports for a step that is this one call; names without a valid token are
    left out."""
    out: dict[str, Tensor] = {}
    for name, red in token_reductions(stats, table).items():
        if int(red.count) == 0:
            continue
        out[f"{name}/avg"] = (red.total / red.count).to(torch.float32)
        out[f"{name}/min"] = red.min
        out[f"{name}/max"] = red.max
    return out


def scalar_stats(stats: dict[str, Tensor]) -> dict[str, Tensor]:
    """The 0-d entries of a loss's stats that are documented in `STATS` (the scalars)."""
    return {k: v for k, v in stats.items() if v.dim() == 0 and k in STATS}


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of `x` where `mask` is true (0 when nothing is valid), as a detached float."""
    m = mask.to(torch.bool)
    n = m.sum()
    total = torch.where(m, x.detach(), 0.0).sum(dtype=torch.float64)
    return (total / n.clamp(min=1)).to(torch.float32)


def masked_min_max(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Min and max of `x` where `mask` is true (0, 0 when nothing is valid)."""
    m = mask.to(torch.bool)
    if not bool(m.any()):
        z = torch.zeros((), dtype=torch.float32, device=x.device)
        return z, z.clone()
    vals = x.detach()[m].to(torch.float32)
    return vals.min(), vals.max()


def scalar(value: float | int | Tensor, device: torch.device | None = None) -> Tensor:
    """A 0-d float32 tensor (stats are tensors so they can be all-reduced as they are)."""
    if isinstance(value, Tensor):
        return value.detach().to(torch.float32).reshape(())
    return torch.tensor(float(value), dtype=torch.float32, device=device)


# Keys of the losses' stats that are AReaL's per-token tensors (or its 0-d
# `filtered_fraction`) rather than reported names.
LOSS_TENSOR_KEYS: frozenset[str] = frozenset(
    {ts.values for t in (ACTOR_TOKEN_STATS, CRITIC_TOKEN_STATS) for ts in t.values()}
    | {ts.mask for t in (ACTOR_TOKEN_STATS, CRITIC_TOKEN_STATS) for ts in t.values()}
    | {"filtered_fraction"}
)


def check_stat_names(stats: dict[str, Tensor]) -> None:
    """Raise if a stat name is neither documented in `STATS` nor one of the per-token
    tensor keys of `LOSS_TENSOR_KEYS` (used by tests and debug runs)."""
    unknown = sorted(set(stats) - set(STATS) - LOSS_TENSOR_KEYS)
    if unknown:
        raise KeyError(f"undocumented stat names {unknown}; add them to STATS")


def stats_table_markdown() -> str:
    """`STATS` as the Markdown table printed in docs/algorithms.md (a test keeps them equal).

    The prox-approximation family is folded into one row with placeholders.
    """
    rows = ["| name | what it is | a bad trend means |", "| --- | --- | --- |"]
    folded = False
    tokens = {**ACTOR_TOKEN_STATS, **CRITIC_TOKEN_STATS}
    for name, (what, bad) in STATS.items():
        base, _, red = name.rpartition("/")
        if base in tokens and red in TOKEN_STAT_REDUCTIONS:
            if red == TOKEN_STAT_REDUCTIONS[0]:
                ts = tokens[base]
                rows.append(
                    f"| `{base}/{{avg,min,max}}` | over `{ts.mask}` tokens: {ts.what} | {ts.bad} |"
                )
            continue
        if name.startswith("prox_approx/"):
            if folded:
                continue
            folded = True
            name = "prox_approx/<method>/<quantity>_<error>"
            what = (
                "method ∈ loglinear, linear, rollout; quantity ∈ logp, behave_imp_weight, "
                "importance_weight; error ∈ abs_error, rel_error, sq_error: the error of the "
                "approximation against the recomputed pi_prox (metrics mode), mean over "
                "generated tokens"
            )
        rows.append(f"| `{name}` | {what} | {bad} |")
    return "\n".join(rows)
