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


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _std(xs: Sequence[float], unbiased: bool) -> float:
    n = len(xs)
    d = n - 1 if unbiased else n
    if d <= 0:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / d)


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
    """The documented semantics: batch level over tokens, group level over sequence means."""
    n = len(x)
    tokens = [[x[i][t] for t in range(len(x[i])) if mask[i][t]] for i in range(n)]
    seq_mean = [(_mean(tok) if tok else None) for tok in tokens]
    all_tokens = [v for tok in tokens for v in tok]

    def group_members(i: int) -> list[int]:
        return [j for j in range(n) if groups[j] == groups[i] and seq_mean[j] is not None]

    out: list[list[float]] = []
    for i in range(n):
        row = []
        for t in range(len(x[i])):
            if not mask[i][t]:
                row.append(0.0)
                continue
            v = x[i][t]
            no_peer = False
            if mean_level == "batch":
                if leave1out:
                    others = [w for j in range(n) if j != i for w in tokens[j]]
                    no_peer = not others
                    base = _mean(others) if others else 0.0
                else:
                    base = _mean(all_tokens)
            elif mean_level == "group":
                members = group_members(i)
                if leave1out:
                    others = [seq_mean[j] for j in members if j != i]
                    no_peer = not others
                    base = _mean(others) if others else 0.0
                else:
                    base = _mean([seq_mean[j] for j in members])
            else:
                base = 0.0
            c = 0.0 if no_peer else v - base
            if std_level == "batch":
                c = c / (_std(all_tokens, unbiased) + eps)
            elif std_level == "group":
                c = c / (_std([seq_mean[j] for j in group_members(i)], unbiased) + eps)
            row.append(c)
        out.append(row)
    return out


def clip_token_loss(
    ratio: float, adv: float, eps_low: float, eps_high: float, c_clip: float | None
) -> float:
    """One token of the PPO clipped surrogate (with optional dual clip)."""
    loss = max(-adv * ratio, -adv * min(max(ratio, 1 - eps_low), 1 + eps_high))
    if c_clip is not None and adv < 0:
        loss = min(loss, -c_clip * adv)
    return loss
