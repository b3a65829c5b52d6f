"""Off-policy corrections on stale tokens: rejection sampling (IcePop, KPop) and M2PO.

Rejection sampling judges each token (or sequence) by a divergence between π_prox and
π_behave, with r = π_prox/π_behave:

| metric | per token | sequence aggregation (`agg`) |
| --- | --- | --- |
| `ratio` | r | in log space: exp(Σ log r), exp(mean log r), max r |
| `kl_k1` / `kl_k2` / `kl_k3` | KL estimators of log r | arithmetic sum / mean / max |
| `binary_kl` | max(KL(Bern(p)‖Bern(q)), KL(Bern(q)‖Bern(p))), p = π_prox, q = π_behave | as KL |

A token is in bounds when `metric <= upper` and (if set) `metric >= lower`. `action: mask`
drops out-of-bounds tokens (or whole sequences) from the loss; `action: clamp` (ratio only)
keeps them with the behaviour weight clamped to `[lower or 0, upper]`. With `level:
sequence` and `metric: ratio` the behaviour weight itself becomes the sequence's geometric
mean ratio. IcePop is `metric: ratio, lower: 0.5, upper: 5`; KPop is `metric: binary_kl`
(AReaL lists `binary_kl` among the choices but its validator rejects it, so its KPop preset
cannot load; here it runs). The bounds apply to every metric the way AReaL's
`apply_rejection_sampling` (`areal/utils/functional/functional.py`, `_check_bounds`)
applies them: `lower`, when set, is a lower bound on `binary_kl` too.

M2PO (second-moment trust, AReaL's `_apply_m2po_masking` in `areal/trainer/ppo/actor.py`):
with M2_t = (log π_behave(t) - log π_prox(t))^2 over the loss tokens of one call (AReaL: one
micro-batch), drop the tokens with the largest M2_t until the mean M2 of the remaining
tokens is strictly below `m2_threshold`; when no set qualifies, only the single token with
the smallest M2 is kept. It runs on the loss mask before rejection sampling. M2PO bounds
staleness instead of the per-step move, so its presets run one minibatch, where the PPO
clip never binds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from services.common.config import RejectionSamplingConfig

from .checks import require_finite
from .kl import KL_ESTIMATORS, binary_kl_symmetric
from .layout import SeqLayout, layout_of, seq_broadcast, seq_max, seq_sum
from .stats import scalar


@dataclass
class RejectionResult:
    loss_mask: Tensor  # bool
    behave_imp_weight: Tensor  # detached, 0 where masked
    filtered_fraction: Tensor  # 0-d


def behave_imp_weight(proximal_logprobs: Tensor, behave_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Decoupled PPO's behaviour weight, the one place it is computed:

    w_t = π_prox(t) / π_behave(t) = exp(log π_prox(t) - log π_behave(t))  on `mask`, else 0
    """
    log_r = torch.where(mask, proximal_logprobs - behave_logprobs, 0.0)
    return torch.where(mask, torch.exp(log_r), 0.0)


def _in_bounds(metric: Tensor, spec: RejectionSamplingConfig) -> Tensor:
    """`lower <= metric <= upper` (no lower bound when unset), for every metric."""
    ok = metric <= spec.upper
    if spec.lower is not None:
        ok = ok & (metric >= spec.lower)
    return ok


def _seq_aggregate(values: Tensor, mask: Tensor, layout: SeqLayout, agg: str) -> Tensor:
    if agg == "max":
        return seq_max(torch.where(mask, values, float("-inf")), layout, fill=float("-inf"))
    total = seq_sum(torch.where(mask, values, 0.0), layout)
    if agg == "sum":
        return total
    return total / seq_sum(mask.to(values.dtype), layout).clamp(min=1)


def apply_rejection_sampling(
    proximal_logprobs: Tensor,
    behave_logprobs: Tensor,
    loss_mask: Tensor,
    spec: RejectionSamplingConfig,
    *,
    cu_seqlens: Tensor | None = None,
) -> RejectionResult:
    """Filter (mask) or truncate (clamp) stale tokens; see the module docstring. `spec` is
    `actor.rejection_sampling`, validated at load."""
    mask = loss_mask.to(torch.bool)
    prox = proximal_logprobs.detach().to(torch.float32)
    behave = behave_logprobs.detach().to(torch.float32)
    require_finite(mask, proximal_logprobs=prox, behave_logprobs=behave)
    log_r = torch.where(mask, prox - behave, 0.0)
    weight = behave_imp_weight(prox, behave, mask)

    if spec.metric == "ratio":
        metric = weight
    elif spec.metric == "binary_kl":
        metric = binary_kl_symmetric(prox, behave)
    else:
        metric = KL_ESTIMATORS.get(spec.metric.removeprefix("kl_"))(prox, behave)
    metric = torch.where(mask, metric, 0.0)

    if spec.level == "token":
        in_bounds = _in_bounds(metric, spec)
    else:
        layout = layout_of(mask, cu_seqlens)
        if spec.metric == "ratio":
            seq_log = _seq_aggregate(log_r, mask, layout, spec.agg)
            seq_metric = torch.exp(seq_log)
            n_tok = seq_sum(mask.to(torch.float32), layout)
            geo = torch.exp(seq_sum(log_r, layout) / n_tok.clamp(min=1))
            weight = seq_broadcast(geo, layout)
        else:
            seq_metric = _seq_aggregate(metric, mask, layout, spec.agg)
        empty = seq_sum(mask.to(torch.float32), layout) == 0
        seq_ok = _in_bounds(seq_metric, spec) | empty
        in_bounds = seq_broadcast(seq_ok, layout)

    n_valid = mask.sum().clamp(min=1)
    if spec.action == "mask":
        new_mask = mask & in_bounds
        filtered = (mask & ~in_bounds).sum() / n_valid
    else:
        lower = 0.0 if spec.lower is None else spec.lower
        clamped = weight.clamp(lower, spec.upper)
        new_weight = torch.where(in_bounds, weight, clamped)
        filtered = (mask & (new_weight != weight)).sum() / n_valid
        weight = new_weight
        new_mask = mask
    weight = torch.where(new_mask, weight, 0.0)
    return RejectionResult(new_mask, weight, scalar(filtered))


def m2po_mask(
    log_ratio: Tensor, loss_mask: Tensor, m2_threshold: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """M2PO: keep the tokens with the smallest (log r)^2 whose mean is < threshold.

    Sorting the valid tokens' M2 ascending, the running mean is non-decreasing, so the kept
    set is the longest prefix whose mean is strictly below `m2_threshold` — the set AReaL's
    `_get_m2po_loss_mask` keeps by masking the largest values first (its suffix means of the
    descending order). When even the smallest M2 is not below the threshold, that one token
    is kept (AReaL masks all but one). Returns the new bool mask and `m2po_second_moment`
    (before masking) / `m2po_masked_fraction`.
    """
    if not m2_threshold > 0:
        raise ValueError(f"m2_threshold must be > 0, got {m2_threshold!r}")
    mask = loss_mask.to(torch.bool)
    m2 = torch.where(mask, log_ratio.detach().to(torch.float64).square(), 0.0)
    flat_mask = mask.reshape(-1)
    vals = m2.reshape(-1)[flat_mask]
    n = vals.numel()
    stats = {
        "m2po_second_moment": scalar(vals.mean() if n else 0.0),
        "m2po_masked_fraction": scalar(0.0),
    }
    if n == 0:
        return mask, stats
    sorted_vals, order = torch.sort(vals)
    running = torch.cumsum(sorted_vals, 0) / torch.arange(
        1, n + 1, dtype=torch.float64, device=vals.device
    )
    keep_n = max(1, int((running < m2_threshold).sum()))
    keep_sorted = torch.arange(n, device=vals.device) < keep_n
    keep = torch.empty_like(keep_sorted)
    keep[order] = keep_sorted
    new_flat = flat_mask.clone()
    new_flat[flat_mask] = keep
    stats["m2po_masked_fraction"] = scalar((n - keep_n) / n)
    return new_flat.reshape(mask.shape), stats
