"""Generalised advantage estimation over generated tokens or generated turns.

Layout: padded `[B, T]`; `values[b, t]` is V(s_t), the value of the state in which token
t is chosen. Only positions with `mask = 1` are timesteps: prompt, tool-output and padding
positions take no step (the recurrence jumps over them), so a multi-turn trajectory is one
episode whose steps are its generated tokens.

Token level (`gae_timestep_unit: token`), for consecutive steps t < t' of one trajectory:

    δ_t = r_t + γ V_{t'} - V_t
    A_t = δ_t + γ λ A_{t'}
    G_t = A_t + V_t                       (critic target, "returns")

After the last step the next value is the bootstrap: V(s_end) for a truncated trajectory
(no EOS: the episode did not end, the critic's estimate stands in for the rest) and 0 for
one that ended with EOS. The flag comes from the trajectory's `no_eos` field, never from
where a sequence stops inside a padded batch.

Turn level (`gae_timestep_unit: turn`, needs `turn_ids`): each non-empty generated turn u
is one step with reward r_u = the sum of its tokens' task rewards and value V_u = the value
at its first generated token; the same recurrence runs over turns and A_u, G_u are
broadcast to every generated token of the turn. With one token per turn this is exactly
token-level GAE.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _as_lambda(lam: Tensor | float, n: int, device: torch.device) -> Tensor:
    if isinstance(lam, Tensor):
        if lam.shape != (n,):
            raise ValueError(f"per-trajectory lambda must have shape [{n}], got {tuple(lam.shape)}")
        return lam.to(device=device, dtype=torch.float32)
    return torch.full((n,), float(lam), dtype=torch.float32, device=device)


def discounted_reverse_cumsum(x: Tensor, factor: Tensor, chunk: int = 64) -> Tensor:
    """y_t = Σ_{k >= t} factor^(k - t) x_k along the last dim, one factor per row.

    Chunked scan: inside a chunk of C steps one batched matrix product with the
    upper-triangular matrix M[i, j] = factor^(j - i) does the work; across chunks a short
    loop (T / C steps) carries y at each chunk's first position backwards with factor^(C - i).
    Powers never go beyond factor^C, so nothing underflows for long sequences.
    """
    n_rows, length = x.shape
    if length == 0 or n_rows == 0:
        return x.clone()
    c = min(chunk, length)
    pad = (-length) % c
    xs = torch.nn.functional.pad(x, (0, pad)).view(n_rows, -1, c)
    idx = torch.arange(c, device=x.device)
    expo = idx.unsqueeze(0) - idx.unsqueeze(1)  # j - i
    upper = expo >= 0
    expo_f = expo.clamp(min=0).to(x.dtype)
    if bool((factor == factor[0]).all()):
        # One factor for every row (a numeric λ): one [C, C] matrix, one matmul.
        mat = torch.where(upper, factor[0].to(x.dtype) ** expo_f, 0.0)
        partial = xs @ mat.T
    else:
        f = factor.to(x.dtype).view(n_rows, 1, 1)
        mat_b = torch.where(upper, f**expo_f, 0.0)  # [B, C, C]
        partial = torch.einsum("bij,bnj->bni", mat_b, xs)
    carry_w = factor.to(x.dtype).unsqueeze(1) ** (c - idx).to(x.dtype)  # [B, C]
    out = torch.empty_like(partial)
    carry = torch.zeros(n_rows, dtype=x.dtype, device=x.device)
    for k in range(partial.shape[1] - 1, -1, -1):
        out[:, k] = partial[:, k] + carry_w * carry.unsqueeze(1)
        carry = out[:, k, 0]
    return out.reshape(n_rows, -1)[:, :length]


def gae_token_level(
    rewards: Tensor,
    mask: Tensor,
    *,
    discount: float,
    gae_lambda: Tensor | float,
    values: Tensor | None = None,
    bootstrap: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Token-level GAE → (advantages, returns), both `[B, T]` and 0 where `mask` is 0.

    `bootstrap` `[B]` is the value after the last step (already 0 for EOS-terminated
    trajectories); None means 0 for all. Vectorised: each row's steps are compacted to
    the left (a stable sort puts masked positions last), the TD errors are formed with the
    next *step*'s value, and A = Σ_k (γλ)^(k-t) δ_k is one chunked scan
    (`discounted_reverse_cumsum`) instead of a Python loop over tokens.
    """
    if rewards.ndim != 2 or mask.shape != rewards.shape:
        raise ValueError(
            f"rewards and mask must be [B, T] of one shape, got {tuple(rewards.shape)} "
            f"and {tuple(mask.shape)}"
        )
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"discount must lie in [0, 1], got {discount!r}")
    n, t_len = rewards.shape
    device = rewards.device
    lam = _as_lambda(gae_lambda, n, device)
    m = mask.to(torch.bool)
    r = rewards.to(torch.float32)
    v = torch.zeros_like(r) if values is None else values.detach().to(torch.float32)
    if v.shape != r.shape:
        raise ValueError(f"values has shape {tuple(v.shape)} but rewards has {tuple(r.shape)}")
    boot = (
        torch.zeros(n, dtype=torch.float32, device=device)
        if bootstrap is None
        else bootstrap.detach().to(device=device, dtype=torch.float32).reshape(n)
    )
    if t_len == 0:
        return torch.zeros_like(r), torch.zeros_like(r)
    # Compact each row's steps to the left, keeping their order.
    order = torch.sort((~m).to(torch.int8), dim=1, stable=True).indices
    n_steps = m.sum(dim=1, keepdim=True)
    pos = torch.arange(t_len, device=device).unsqueeze(0)
    step = pos < n_steps
    r_c = torch.where(step, torch.gather(r, 1, order), 0.0)
    v_c = torch.where(step, torch.gather(v, 1, order), 0.0)
    next_v = torch.cat([v_c[:, 1:], torch.zeros_like(v_c[:, :1])], dim=1)
    next_v = torch.where(pos == n_steps - 1, boot.unsqueeze(1), next_v)
    delta = torch.where(step, r_c + discount * next_v - v_c, 0.0)
    adv_c = torch.where(step, discounted_reverse_cumsum(delta, discount * lam), 0.0)
    adv = torch.zeros_like(r).scatter(1, order, adv_c)
    returns = torch.where(m, adv + v, 0.0)
    return adv, returns


def turn_slots(mask: Tensor, turn_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Map generated tokens to dense turn slots.

    Returns `(slot [B, T], new_turn [B, T], turn_counts [B])`: `slot` is the 0-based index
    of the token's turn among its trajectory's non-empty generated turns (only meaningful
    where `mask`), `new_turn` marks the first generated token of each turn. Raises when a
    generated token has a negative turn id or when ids decrease along a trajectory.
    """
    if turn_ids.shape != mask.shape:
        raise ValueError(
            f"turn_ids has shape {tuple(turn_ids.shape)} but loss_mask has {tuple(mask.shape)}"
        )
    if turn_ids.dtype.is_floating_point or turn_ids.dtype == torch.bool:
        raise ValueError(f"turn_ids must be an integer tensor, got {turn_ids.dtype}")
    m = mask.to(torch.bool)
    ids = turn_ids.to(torch.int64)
    if bool((m & (ids < 0)).any()):
        raise ValueError(
            "turn_ids must be >= 0 on every generated (loss_mask=1) token; -1 marks prompt, "
            "tool and padding positions only"
        )
    n, t_len = m.shape
    pos = torch.arange(t_len, device=m.device).expand(n, t_len)
    last_active = torch.cummax(torch.where(m, pos, -1), dim=1).values
    prev_idx = torch.cat(
        [torch.full((n, 1), -1, dtype=torch.int64, device=m.device), last_active[:, :-1]], dim=1
    )
    prev_turn = torch.where(
        prev_idx >= 0, torch.gather(ids, 1, prev_idx.clamp(min=0)), torch.full_like(ids, -1)
    )
    if bool((m & (ids < prev_turn)).any()):
        raise ValueError("turn_ids must be non-decreasing over a trajectory's generated tokens")
    new_turn = m & (ids != prev_turn)
    slot = torch.cumsum(new_turn.to(torch.int64), dim=1) - 1
    turn_counts = new_turn.sum(dim=1)
    return slot, new_turn, turn_counts


def gae_turn_level(
    rewards: Tensor,
    mask: Tensor,
    turn_ids: Tensor,
    *,
    discount: float,
    gae_lambda: Tensor | float,
    values: Tensor | None = None,
    bootstrap: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Turn-level GAE → per-token (advantages, returns) `[B, T]`, 0 where `mask` is 0.

    `rewards` are the per-token *task* rewards (keep the KL penalty out: it is added per
    token by the caller, not summed into a turn and broadcast back).
    """
    m = mask.to(torch.bool)
    slot, new_turn, turn_counts = turn_slots(m, turn_ids)
    n = m.shape[0]
    n_turns = int(turn_counts.max()) if n else 0
    device = rewards.device
    safe_slot = slot.clamp(min=0)
    r_turn = torch.zeros(n, n_turns, dtype=torch.float32, device=device)
    r_turn.scatter_add_(1, safe_slot, torch.where(m, rewards.to(torch.float32), 0.0))
    v_turn = torch.zeros(n, n_turns, dtype=torch.float32, device=device)
    if values is not None:
        v_src = torch.where(new_turn, values.detach().to(torch.float32), 0.0)
        v_turn.scatter_add_(1, safe_slot, v_src)
    exists = torch.arange(n_turns, device=device).unsqueeze(0) < turn_counts.unsqueeze(1)
    adv_turn, ret_turn = gae_token_level(
        r_turn,
        exists,
        discount=discount,
        gae_lambda=gae_lambda,
        values=v_turn,
        bootstrap=bootstrap,
    )
    if n_turns == 0:
        zeros = torch.zeros_like(rewards, dtype=torch.float32)
        return zeros, zeros.clone()
    adv = torch.where(m, torch.gather(adv_turn, 1, safe_slot), 0.0)
    returns = torch.where(m, torch.gather(ret_turn, 1, safe_slot), 0.0)
    return adv, returns
