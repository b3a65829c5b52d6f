"""Reward service throughput beside the same verifier in-process, and deadline overshoot.

1. Throughput: the same GSM8K-style completions (n_samples per prompt, worked solutions
   ending in an answer, about half of them right) are scored
   - in-process: `gsm8k_reward` called in one loop, as a rollout that scores inline would;
   - through the service: a real gRPC server on loopback with the default pool
     (`RewardConfig()` defaults; only the result cache is off so that both sides do the
     same verifier work), fed by `RewardClient` with a rollout-like number of batches in
     flight.
   `throughput_ratio_vs_inprocess` = service completions/s ÷ in-process completions/s.
2. Deadline overshoot: items whose verifier really hangs (math-verify on
   `\\boxed{9^{9^{9^{9}}}}`: sympy expands the power tower) are sent with a deadline; the
   time the client waits for the TIMEOUT, divided by the deadline, is the overshoot
   (p99 over all samples). One wave per worker count, each wave after every worker is
   ready again, so queueing behind respawns is not what is measured.

Prints one JSON line. Usage: `.venv/bin/python benchmarks/reward.py [--prompts 256]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from services.common.config import RewardConfig  # noqa: E402
from services.core.types import RewardStatus, ScoreRequest  # noqa: E402
from services.reward.builtins import gsm8k_reward  # noqa: E402
from services.reward.client import RewardClient  # noqa: E402
from services.reward.service import RewardParts, RewardService  # noqa: E402

HANG = "\\boxed{9^{9^{9^{9}}}}"


def make_items(prompts: int, samples: int, seed: int) -> list[ScoreRequest]:
    """Worked solutions as models write them; the answer right about half of the time."""
    rng = random.Random(seed)
    items = []
    for p in range(prompts):
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(1, 999)
        gold = a * b + c
        answer = f"{a} * {b} = <<{a}*{b}={a * b}>>{a * b}\n{a * b} + {c} = <<{a * b}+{c}={gold}>>{gold}\n#### {gold}"
        for _ in range(samples):
            got = gold if rng.random() < 0.5 else gold + rng.randint(1, 20)
            ending = rng.choice(
                [f"#### {got}", f"The answer is {got:,}.", f"So the total is $\\boxed{{{got}}}$."]
            )
            text = (
                f"Problem {p}: first multiply {a} by {b} to get {a * b}. "
                f"Then add {c}, giving {a * b} + {c}. Let me double-check: {a} x {b} is "
                f"{a * b}, and adding {c} makes it {got}.\n{ending}"
            )
            items.append(ScoreRequest(completion=text, answer=answer, prompt=f"Q{p}"))
    return items


def in_process(items: list[ScoreRequest]) -> tuple[float, list[float]]:
    gsm8k_reward("", "#### 1", [], [], "1")  # import and warm up, as the workers do
    start = time.perf_counter()
    rewards = [gsm8k_reward(i.prompt, str(i.completion), [], [], i.answer) for i in items]
    return len(items) / (time.perf_counter() - start), rewards


async def through_service(
    client: RewardClient, items: list[ScoreRequest], batch: int, in_flight: int
) -> tuple[float, list[float]]:
    parts = [items[k : k + batch] for k in range(0, len(items), batch)]
    gate = asyncio.Semaphore(in_flight)

    async def send(part: list[ScoreRequest]) -> list[float]:
        async with gate:
            out = await client.score_batch(part, fn="gsm8k")
        if any(o.status is not RewardStatus.OK for o in out):
            raise RuntimeError(f"unexpected statuses: {[o.message for o in out if not o.ok]}")
        return [o.reward for o in out]

    start = time.perf_counter()
    results = await asyncio.gather(*(send(p) for p in parts))
    elapsed = time.perf_counter() - start
    return len(items) / elapsed, [r for part in results for r in part]


async def overshoot(
    service: RewardService, client: RewardClient, deadline_ms: int, waves: int
) -> list[float]:
    workers = service.pool.config.num_workers
    ratios: list[float] = []
    for _ in range(waves):
        while service.pool.ready_workers < workers:
            await asyncio.sleep(0.02)

        async def one() -> float:
            t0 = time.perf_counter()
            out = await client.score(
                ScoreRequest(completion=HANG, answer="1"), fn="math", deadline_s=deadline_ms / 1000
            )
            waited = time.perf_counter() - t0
            if out.status is not RewardStatus.TIMEOUT:
                raise RuntimeError(f"expected TIMEOUT, got {out.status}: {out.message}")
            return waited / (deadline_ms / 1000)

        ratios.extend(await asyncio.gather(*(one() for _ in range(workers))))
    return ratios


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    config = RewardConfig(fn="gsm8k", cache=False)
    service = RewardService(RewardParts(reward=config, metrics_port=None))
    await service.start()
    inproc_s = service_s = 0.0
    per_slice: list[float] = []
    rewards: list[float] = []
    try:
        async with RewardClient(service.address, timeout=600) as client:
            # Warm the channel and the workers (the in-process loop warms itself likewise).
            await client.score_batch(make_items(1, config.num_workers, -1), fn="gsm8k")
            # The two sides alternate in short slices, each on fresh items (no gold-answer
            # cache is warm on either side), and the ratio is of total times: on a shared
            # machine the load from other processes then falls on both sides alike.
            for k in range(args.slices):
                items = make_items(args.prompts, args.samples, args.seed + k)
                order = ("inproc", "service") if k % 2 == 0 else ("service", "inproc")
                times: dict[str, float] = {}
                for side in order:
                    if side == "inproc":
                        rate, inproc_rewards = in_process(items)
                    else:
                        rate, service_rewards = await through_service(
                            client, items, config.max_batch, args.in_flight
                        )
                    times[side] = len(items) / rate
                if service_rewards != inproc_rewards:
                    raise RuntimeError("the service and the in-process loop disagree on rewards")
                inproc_s += times["inproc"]
                service_s += times["service"]
                per_slice.append(times["inproc"] / times["service"])
                rewards.extend(inproc_rewards)
            ratios = await overshoot(service, client, args.deadline_ms, args.waves)
    finally:
        await service.stop()
    n = len(rewards)
    return {
        "bench": "reward",
        "throughput_ratio_vs_inprocess": round(inproc_s / service_s, 3),
        "deadline_overshoot_p99": round(p99(ratios), 4),
        "service_completions_per_s": round(n / service_s, 1),
        "inprocess_completions_per_s": round(n / inproc_s, 1),
        "throughput_ratio_slice_median": round(median(per_slice), 3),
        "completions_per_side": n,
        "slices": args.slices,
        "mean_reward": round(sum(rewards) / n, 4),
        "num_workers": config.num_workers,
        "max_batch": config.max_batch,
        "batches_in_flight": args.in_flight,
        "deadline_ms": args.deadline_ms,
        "overshoot_samples": len(ratios),
        "overshoot_max": round(max(ratios), 4),
        "cpu_count": os.cpu_count(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64, help="prompts per slice")
    parser.add_argument("--samples", type=int, default=8, help="completions per prompt")
    parser.add_argument("--in-flight", type=int, default=8, help="ScoreBatch calls at once")
    parser.add_argument("--deadline-ms", type=int, default=1000)
    parser.add_argument("--waves", type=int, default=5)
    parser.add_argument("--slices", type=int, default=12, help="alternating measurements")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main_async(args))))


if __name__ == "__main__":
    main()
