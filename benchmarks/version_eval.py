"""Held-out accuracy of published weight versions, scored after a run on one fixed version each.

The launcher's evaluation goes through the running rollout replica while the trainer trains
on, so one evaluation can mix versions, and it competes with training for the replica. A
benchmark that compares runs needs "step N" to mean exactly version N: this module loads the
run's base model into an in-process torch engine (the same engine the replicas run), applies
each published version directory `<weight_dir>/v<version:08d>/` in turn (the disk transport's
own load and checksum check), samples one completion per held-out prompt and scores it with
the run's reward function, called in-process.

Sampling seeds depend only on the prompt's position (`seed + i`), not on the version or the
run, so two runs scored at the same version with the same seed see the same random numbers:
their difference is the weights' difference, not the sampler's (common random numbers).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.core.types import SamplingParams
from services.reward.registry import RewardRegistry, load_callable
from services.rollout.data.datasets import render_prompt
from services.rollout.engine.torch_engine import TorchEngine
from services.trainer.weight_sync import version_dir


@dataclass(frozen=True)
class VersionScore:
    version: int
    accuracy: float
    mean_reward: float
    n: int
    completions: tuple[str, ...] = ()
    """Each row's completion text, in row order."""


def _reward_fn(name: str) -> Any:
    return load_callable(RewardRegistry().resolve(name).path)


async def _score_all(
    model_dir: Path,
    weight_dir: Path | None,
    versions: Sequence[int],
    rows: Sequence[dict[str, Any]],
    *,
    reward_fn: str,
    temperature: float,
    max_new_tokens: int,
    seed: int,
    prompt_key: str,
    answer_key: str,
) -> list[VersionScore]:
    engine = TorchEngine(model_dir, device="cpu", max_batch_size=max(1, len(rows)), seed=seed)
    await engine.start()
    fn = _reward_fn(reward_fn)
    prompts = [render_prompt(engine.tokenizer, str(r[prompt_key])) for r in rows]
    scores: list[VersionScore] = []
    try:
        for v in sorted(versions):
            if v > 0:
                if weight_dir is None:
                    raise ValueError(f"version {v} needs a weight directory")
                result = await engine.update_weights_from_disk(
                    str(version_dir(weight_dir, v)), None
                )
                if not result.ok:
                    raise RuntimeError(f"version {v}: {result.message}")
            completions = await asyncio.gather(
                *(
                    engine.agenerate(
                        ids,
                        SamplingParams(
                            temperature=temperature,
                            greedy=temperature == 0.0,
                            max_new_tokens=max_new_tokens,
                            seed=seed + i,
                        ),
                    )
                    for i, (_, ids) in enumerate(prompts)
                )
            )
            texts = [c.text for c in completions]
            rewards = [
                float(fn(text, out, ids, list(c.output_ids), str(row[answer_key])))
                for (text, ids), out, c, row in zip(prompts, texts, completions, rows, strict=True)
            ]
            n = len(rewards)
            scores.append(
                VersionScore(
                    version=v,
                    accuracy=sum(r >= 1.0 - 1e-6 for r in rewards) / n if n else 0.0,
                    mean_reward=sum(rewards) / n if n else 0.0,
                    n=n,
                    completions=tuple(texts),
                )
            )
    finally:
        await engine.stop()
    return scores


def score_versions(
    model_dir: Path,
    weight_dir: Path | None,
    versions: Sequence[int],
    rows: Sequence[dict[str, Any]],
    *,
    reward_fn: str = "gsm8k",
    temperature: float = 1.0,
    max_new_tokens: int = 16,
    seed: int = 0,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
) -> list[VersionScore]:
    """Score each of `versions` (0 = the model in `model_dir` itself) on `rows`, one
    sampled completion per row, in increasing version order."""
    return asyncio.run(
        _score_all(
            model_dir,
            weight_dir,
            versions,
            rows,
            reward_fn=reward_fn,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            seed=seed,
            prompt_key=prompt_key,
            answer_key=answer_key,
        )
    )
