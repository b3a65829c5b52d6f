"""`version_eval.score_versions`: fixed-version held-out scoring for the benchmarks.

References: Hugging Face `generate` (greedy) on the same weights gives the completions, and
the real reward service scoring through the launcher's `evaluate` (a real rollout server on
loopback) gives the rewards; the weights of version 1 are written by the disk transport's
own writer, as the trainer publishes them.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.common.weights.disk import save_weights
from services.common.weights.manifest import named_parameters_for_update
from services.launcher.evaluation import evaluate
from services.rollout.data.datasets import render_prompt
from services.trainer.weight_sync import version_dir
from tests.fixtures_models import tiny_model_dir  # noqa: F401 - fixture
from tests.reward.conftest import RunningReward, service_config
from tests.rollout.conftest import engine, served  # noqa: F401 - fixtures

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from version_eval import score_versions  # noqa: E402

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (5, 6), (7, 1)]]
NEW = 4


def hf_greedy(model: Any, tokenizer: Any, rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for row in rows:
        _, ids = render_prompt(tokenizer, row["prompt"])
        gen = model.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=NEW, pad_token_id=0
        )
        out.append(tokenizer.decode(gen[0, len(ids) :], skip_special_tokens=True))
    return out


def perturbed(model_dir: Path) -> Any:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=gen))
    return model


def test_each_version_is_scored_on_its_own_weights(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    moved = perturbed(tiny_model_dir)
    save_weights(version_dir(tmp_path, 3), named_parameters_for_update(moved), 3)
    scores = score_versions(
        tiny_model_dir, tmp_path, [3, 0], ROWS, temperature=0.0, max_new_tokens=NEW
    )
    assert [s.version for s in scores] == [0, 3]  # in version order, whatever was asked
    assert list(scores[0].completions) == hf_greedy(base, tokenizer, ROWS)
    assert list(scores[1].completions) == hf_greedy(moved, tokenizer, ROWS)
    assert scores[0].completions != scores[1].completions  # the perturbation shows


def test_sampling_repeats_with_its_seed_and_changes_without(tiny_model_dir: Path) -> None:  # noqa: F811
    rows = ROWS * 8
    a = score_versions(tiny_model_dir, None, [0], rows, max_new_tokens=NEW, seed=5)
    b = score_versions(tiny_model_dir, None, [0], rows, max_new_tokens=NEW, seed=5)
    c = score_versions(tiny_model_dir, None, [0], rows, max_new_tokens=NEW, seed=6)
    assert a[0].completions == b[0].completions
    assert a[0].completions != c[0].completions


def test_a_missing_version_is_an_error(tiny_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    with pytest.raises(RuntimeError, match="version 2"):
        score_versions(tiny_model_dir, tmp_path, [2], ROWS, max_new_tokens=NEW)


@pytest.mark.integration
async def test_rewards_agree_with_the_services_evaluation(
    served,  # noqa: ANN001, F811
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    _, client, _ = served
    svc = RunningReward(service_config(num_workers=1))
    try:
        through_services = await asyncio.to_thread(
            evaluate,
            client.address,
            svc.address,
            ROWS,
            reward_fn="gsm8k",
            temperature=0.0,
            max_new_tokens=NEW,
        )
    finally:
        svc.stop()
    (offline,) = await asyncio.to_thread(
        score_versions, tiny_model_dir, None, [0], ROWS, temperature=0.0, max_new_tokens=NEW
    )
    assert offline.n == through_services.n == len(ROWS)
    assert offline.accuracy == through_services.accuracy
    assert offline.mean_reward == pytest.approx(through_services.mean_reward)
