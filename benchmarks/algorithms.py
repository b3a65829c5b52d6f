"""Algorithm-core throughput: advantages + loss + backward, vectorised vs a plain loop.

For GRPO, decoupled PPO with the log-linear proximal approximation, and GSPO, on a
64 x 1024-token padded batch on CPU, times the full path the trainer runs once per
minibatch — rewards → group/batch normalisation → GAE → (π_prox approximation) → actor
loss → backward — with the vectorised functions of `services.trainer.algorithms`, and
beside it, in the same run on the same batch, a naive implementation of the same maths
that loops over sequences (and over tokens for GAE and the statistics). Both must give
the same loss and gradient (checked; the differences are reported). The figure is the
ratio of the two throughputs.

Prints exactly one JSON line:
    python benchmarks/algorithms.py [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.config import NormConfig, PPOActorConfig  # noqa: E402
from services.common.config.views import ActorLossView, AdvantageView  # noqa: E402
from services.trainer.algorithms import (  # noqa: E402
    compute_advantages,
    compute_prox_logp,
    ppo_actor_loss,
)

B, T, GROUP = 64, 1024, 8
EPS_CLIP, EPS = 0.2, 1e-5
CURRENT_VERSION = 5


@dataclass
class Batch:
    loss_mask: torch.Tensor  # [B, T] bool
    rewards: torch.Tensor  # [B]
    no_eos: torch.Tensor  # [B]
    group_ids: torch.Tensor  # [B]
    behave: torch.Tensor  # [B, T] π_behave
    prox: torch.Tensor  # [B, T] recomputed π_prox (GRPO, GSPO)
    theta: torch.Tensor  # [B, T] π_θ (the leaf the gradient is taken for)
    versions: torch.Tensor  # [B, T]


def make_batch(seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(32, 128, (B,), generator=g)
    length = torch.randint(256, T + 1, (B,), generator=g)
    pos = torch.arange(T).unsqueeze(0)
    mask = (pos >= prompt.unsqueeze(1)) & (pos < length.unsqueeze(1))
    behave = torch.where(mask, -torch.rand(B, T, generator=g) * 4, 0.0)
    versions = torch.where(
        mask, torch.randint(CURRENT_VERSION - 3, CURRENT_VERSION + 1, (B, T), generator=g), -1
    )
    return Batch(
        loss_mask=mask,
        rewards=(torch.rand(B, generator=g) < 0.5).float(),
        no_eos=length == T,
        group_ids=torch.arange(B) // GROUP,
        behave=behave,
        prox=behave + 0.05 * torch.randn(B, T, generator=g),
        theta=behave + 0.1 * torch.randn(B, T, generator=g),
        versions=versions,
    )


ALGOS: dict[str, dict] = {
    "grpo": {"level": "token", "decoupled": False},
    "decoupled_ppo_loglinear": {"level": "token", "decoupled": True},
    "gspo": {"level": "sequence", "decoupled": False},
}


# ----------------------------------------------------------------------------- vectorised


def vectorised(batch: Batch, level: str, decoupled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    actor = PPOActorConfig(
        reward_norm=NormConfig(mean_level="group", std_level="group", eps=EPS),
        adv_norm=NormConfig(mean_level="batch", std_level="batch", eps=EPS),
        eps_clip=EPS_CLIP,
        importance_sampling_level=level,
        use_decoupled_loss=decoupled,
        prox_logp_method="loglinear" if decoupled else "recompute",
    )
    adv = compute_advantages(
        AdvantageView.of(actor),
        rewards=batch.rewards,
        loss_mask=batch.loss_mask,
        no_eos=batch.no_eos,
        group_ids=batch.group_ids,
    )
    theta = batch.theta.clone().requires_grad_(True)
    if decoupled:
        prox = compute_prox_logp(
            "loglinear",
            theta_logprobs=theta,
            behave_logprobs=batch.behave,
            versions=batch.versions,
            current_version=CURRENT_VERSION,
            loss_mask=adv.loss_mask,
        ).prox_logprobs
    else:
        prox = batch.prox
    loss, _ = ppo_actor_loss(
        theta,
        prox,
        adv.advantages,
        adv.loss_mask,
        ActorLossView.of(actor),
        behave_logprobs=batch.behave if decoupled else None,
    )
    loss.backward()
    assert theta.grad is not None
    return loss.detach(), theta.grad


# ----------------------------------------------------------------------------- naive loop


def _mean_std(xs: list[float]) -> tuple[float, float]:
    n = len(xs)
    mean = sum(xs) / n
    var = sum((x - mean) ** 2 for x in xs) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(var)


def naive(batch: Batch, level: str, decoupled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    masks = batch.loss_mask.tolist()
    rewards = batch.rewards.tolist()
    groups = batch.group_ids.tolist()
    # reward_norm at group level, one sequence at a time
    by_group: dict[int, list[float]] = defaultdict(list)
    for i in range(B):
        by_group[groups[i]].append(rewards[i])
    shaped = []
    for i in range(B):
        mean, std = _mean_std(by_group[groups[i]])
        shaped.append((rewards[i] - mean) / (std + EPS))
    # token GAE (γ = λ = 1, no critic): a backwards loop over each sequence's tokens
    adv_rows: list[list[float]] = []
    for i in range(B):
        steps = [t for t in range(T) if masks[i][t]]
        row = [0.0] * T
        last = 0.0
        for k, t in enumerate(reversed(steps)):
            r = shaped[i] if k == 0 else 0.0
            last = r + last
            row[t] = last
        adv_rows.append(row)
    # adv_norm at batch level over all valid tokens
    flat = [adv_rows[i][t] for i in range(B) for t in range(T) if masks[i][t]]
    mean, std = _mean_std(flat)
    theta = batch.theta.clone().requires_grad_(True)
    n_tokens = len(flat)
    total = torch.zeros(())
    for i in range(B):
        idx = torch.tensor([t for t in range(T) if masks[i][t]], dtype=torch.long)
        a = torch.tensor([(adv_rows[i][t] - mean) / (std + EPS) for t in idx.tolist()])
        lp = theta[i, idx]
        behave = batch.behave[i, idx]
        if decoupled:
            v_b = batch.versions[i, idx].double()
            span = CURRENT_VERSION + 1 - v_b
            alpha = torch.where(span > 0, (CURRENT_VERSION - v_b) / span, 0.0).clamp(0, 1).float()
            prox = behave + alpha * (lp.detach() - behave)
        else:
            prox = batch.prox[i, idx]
        log_ratio = lp - prox
        if level == "sequence":
            ratio = torch.exp(log_ratio.mean()).expand_as(lp)
            a = a.mean().expand_as(lp)
        else:
            ratio = torch.exp(log_ratio)
        per_tok = torch.maximum(-a * ratio, -a * ratio.clamp(1 - EPS_CLIP, 1 + EPS_CLIP))
        if decoupled:
            per_tok = per_tok * torch.exp(prox - behave)
        total = total + per_tok.sum()
    loss = total / n_tokens
    loss.backward()
    assert theta.grad is not None
    return loss.detach(), theta.grad


# ----------------------------------------------------------------------------- timing


def _time(fn: Callable[[], object], repeats: int) -> float:
    """Best of `repeats` after a warm-up: the least disturbed run on a shared machine."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--loop-repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batch = make_batch()
    tokens = B * T
    results = {}
    for name, algo in ALGOS.items():
        v_loss, v_grad = vectorised(batch, **algo)
        n_loss, n_grad = naive(batch, **algo)
        t_vec = _time(lambda algo=algo: vectorised(batch, **algo), args.repeats)
        t_loop = _time(lambda algo=algo: naive(batch, **algo), args.loop_repeats)
        results[name] = {
            "vectorised_tokens_per_s": round(tokens / t_vec),
            "loop_tokens_per_s": round(tokens / t_loop),
            "vectorised_ms": round(t_vec * 1e3, 2),
            "loop_ms": round(t_loop * 1e3, 2),
            "speedup_vs_loop": round(t_loop / t_vec, 2),
            "max_abs_diff_loss": float((v_loss - n_loss).abs()),
            "max_abs_diff_grad": float((v_grad - n_grad).abs().max()),
            "same_result": bool(
                torch.allclose(v_loss, n_loss, rtol=1e-4, atol=1e-6)
                and torch.allclose(v_grad, n_grad, rtol=1e-4, atol=1e-8)
            ),
        }
    speedups = [r["speedup_vs_loop"] for r in results.values()]
    line = {
        "bench": "algorithms",
        "batch": [B, T],
        "tokens": tokens,
        "valid_tokens": int(batch.loss_mask.sum()),
        "threads": args.threads,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "timing": f"best of {args.repeats} (vectorised) / {args.loop_repeats} (loop) after a warm-up",
        "speedup_vs_loop": round(math.exp(sum(math.log(s) for s in speedups) / len(speedups)), 2),
        "min_speedup_vs_loop": min(speedups),
        "all_same_result": all(r["same_result"] for r in results.values()),
        "results": results,
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()
