"""Plain-Python oracles: the same maths as the algorithm core, one sequence and one token at
a time, written from the formulas in docs/algorithms.md (not from the vectorised code).

They are slow on purpose; tests compare the vectorised functions against them on random
inputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def gae_sequence(
    rewards: Sequence[float],
    values: Sequence[float],
    mask: Sequence[bool],
    *,
    discount: float,
    lam: float,
    bootstrap: float,
) -> tuple[list[float], list[float]]:
    """Token GAE for one sequence; masked positions are skipped and get 0."""
    steps = [t for t, m in enumerate(mask) if m]
    adv = [0.0] * len(mask)
    ret = [0.0] * len(mask)
    next_value = bootstrap
    last = 0.0
    for t in reversed(steps):
        delta = rewards[t] + discount * next_value - values[t]
        last = delta + discount * lam * last
        adv[t] = last
        ret[t] = last + values[t]
        next_value = values[t]
    return adv, ret


def turn_gae_sequence(
    rewards: Sequence[float],
    values: Sequence[float],
    mask: Sequence[bool],
    turn_ids: Sequence[int],
    *,
    discount: float,
    lam: float,
    bootstrap: float,
) -> tuple[list[float], list[float]]:
    """Turn GAE for one sequence: a turn's reward is the sum of its tokens' rewards, its
    value the value at its first token; results are broadcast back to the turn's tokens."""
    turns: list[list[int]] = []
    current = None
    for t, m in enumerate(mask):
        if not m:
            continue
        if turn_ids[t] != current:
            turns.append([])
            current = turn_ids[t]
        turns[-1].append(t)
    r_turn = [sum(rewards[t] for t in tok) for tok in turns]
    v_turn = [values[tok[0]] for tok in turns]
    a_turn, g_turn = gae_sequence(
        r_turn, v_turn, [True] * len(turns), discount=discount, lam=lam, bootstrap=bootstrap
    )
    adv = [0.0] * len(mask)
    ret = [0.0] * len(mask)
    for u, tok in enumerate(turns):
        for t in tok:
            adv[t] = a_turn[u]
            ret[t] = g_turn[u]
    return adv, ret


def normalize_tokens(
    x: Sequence[Sequence[float]],
    mask: Sequence[Sequence[bool]],
    groups: Sequence[int],
    *,
    mean_level: str | None,
    std_level: str | None,
    leave1out: bool,
    unbiased: bool,
    eps: float,
) -> list[list[float]]:
    """AReaL 2.0's `Normalization` (areal/utils/data.py) one token at a time.

    Every token with mask 1 is one element; a batch or a group (the rows with the same id;
    -1 = no group) is a pool of elements. mean: the pool mean, or under leave-one-out
    (S - x) / (n - 1) for a valid token, the plain mean for a masked one, 0 when the pool
    has at most one valid token, and x itself in a group of one row. std: over the pool,
    of (x - mean) with each element's own mean; 1 where undefined (n <= 1 unbiased, n = 0
    biased, a group of one row unbiased); no std: 1 and eps 0. No valid token: x unchanged.
    """
    n = len(x)
    if not any(m for row in mask for m in row):
        return [list(row) for row in x]

    def pool(level: str, i: int) -> list[int] | None:
        if level == "batch":
            return list(range(n))
        if groups[i] < 0:
            return None
        return [j for j in range(n) if groups[j] == groups[i]]

    def valid_values(rows: list[int]) -> list[float]:
        return [x[j][t] for j in rows for t in range(len(x[j])) if mask[j][t]]

    means = [[0.0] * len(x[i]) for i in range(n)]
    if mean_level is not None:
        for i in range(n):
            rows = pool(mean_level, i)
            if rows is None:
                continue
            vals = valid_values(rows)
            for t in range(len(x[i])):
                if mean_level == "group" and leave1out and len(rows) == 1:
                    means[i][t] = x[i][t]
                elif leave1out:
                    if len(vals) <= 1:
                        means[i][t] = 0.0
                    elif mask[i][t]:
                        means[i][t] = (sum(vals) - x[i][t]) / (len(vals) - 1)
                    else:
                        means[i][t] = sum(vals) / len(vals)
                else:
                    means[i][t] = sum(vals) / len(vals) if vals else 0.0

    out: list[list[float]] = []
    for i in range(n):
        if std_level is None:
            std, e = 1.0, 0.0
        else:
            rows = pool(std_level, i)
            e = eps
            if rows is None:
                std = 1.0
            else:
                dev = [
                    (x[j][t] - means[j][t]) ** 2
                    for j in rows
                    for t in range(len(x[j]))
                    if mask[j][t]
                ]
                k = len(dev)
                if std_level == "group" and unbiased and len(rows) == 1:
                    std = 1.0
                elif unbiased:
                    std = 1.0 if k <= 1 else math.sqrt(sum(dev) / (k - 1))
                else:
                    std = 1.0 if k == 0 else math.sqrt(sum(dev) / k)
        out.append(
            [(x[i][t] - means[i][t]) / (std + e) if mask[i][t] else 0.0 for t in range(len(x[i]))]
        )
    return out


def clip_token_loss(
    ratio: float, adv: float, eps_low: float, eps_high: float, c_clip: float | None
) -> float:
    """One token of the PPO clipped surrogate (with optional dual clip)."""
    loss = max(-adv * ratio, -adv * min(max(ratio, 1 - eps_low), 1 + eps_high))
    if c_clip is not None and adv < 0:
        loss = min(loss, -c_clip * adv)
    return loss
