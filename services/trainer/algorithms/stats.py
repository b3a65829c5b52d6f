"""Training-health statistics: every name in one table, and the masked reductions.

Every function of the algorithm core returns its statistics as a `dict[str, Tensor]` of
0-d float tensors whose keys are listed in `STATS` (a test checks that no function emits a
name that is not in the table, and `docs/algorithms.md` renders the same table). Means are
over the valid tokens (or sequences) of the call; `n_valid_tokens` and `n_seqs` come with
them so the trainer can weight statistics of several micro-batches or ranks correctly.
"""

from __future__ import annotations

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
        "mean per-sequence reward after overlong penalty, bias, scaling, clip and reward_norm",
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
    # -- actor loss (ppo_actor_loss) -------------------------------------------------------
    "actor_loss": ("aggregated actor loss (detached)", "—"),
    "importance_weight": (
        "mean ratio pi_theta/pi_prox over valid tokens (GSPO: the sequence ratio)",
        "far from 1: the update moves too far per minibatch",
    ),
    "approx_kl": ("mean log pi_theta - log pi_prox", "grows: step size too large"),
    "clip_ratio": ("fraction of valid tokens where the clip binds", "high: lr or eps too tight"),
    "dual_clip_ratio": ("fraction of valid tokens where the dual clip binds", "—"),
    "behave_imp_weight": (
        "mean pi_prox/pi_behave over kept tokens (decoupled loss)",
        "far from 1: rollouts are stale or engine and trainer disagree",
    ),
    "behave_approx_kl": (
        "mean log pi_prox - log pi_behave over kept tokens",
        "grows: staleness or an inference/training mismatch",
    ),
    "rejection_filtered_fraction": (
        "fraction of valid tokens masked (mask) or clamped (clamp) by rejection sampling",
        "high: too much stale data is thrown away",
    ),
    "m2po_masked_fraction": ("fraction of valid tokens masked by M2PO", "high: very stale data"),
    "m2po_second_moment": ("mean (log pi_prox/pi_behave)^2 before M2PO masking", "—"),
    "sapo_gate": ("mean SAPO soft gate over valid tokens", "—"),
    "entropy": ("mean token entropy of pi_theta (when given)", "collapses: no exploration"),
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
    # -- critic (critic_loss) --------------------------------------------------------------
    "value_loss": ("aggregated critic loss (detached)", "does not fall: critic does not learn"),
    "value_clip_ratio": (
        "fraction of valid tokens where value clipping binds",
        "high: eps too small",
    ),
    "values": ("mean predicted value over valid tokens", "—"),
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


def check_stat_names(stats: dict[str, Tensor]) -> None:
    """Raise if a stat name is not documented in `STATS` (used by tests and debug runs)."""
    unknown = sorted(set(stats) - set(STATS))
    if unknown:
        raise KeyError(f"undocumented stat names {unknown}; add them to STATS")


def stats_table_markdown() -> str:
    """`STATS` as the Markdown table printed in docs/algorithms.md (a test keeps them equal).

    The prox-approximation family is folded into one row with placeholders.
    """
    rows = ["| name | what it is | a bad trend means |", "| --- | --- | --- |"]
    folded = False
    for name, (what, bad) in STATS.items():
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
