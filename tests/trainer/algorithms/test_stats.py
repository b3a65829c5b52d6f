"""Statistics are named once: the `STATS` table, the docs table, and the public API."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import services.trainer.algorithms as algorithms
from services.trainer.algorithms.stats import (
    ACTOR_TOKEN_STATS,
    CRITIC_TOKEN_STATS,
    STATS,
    check_stat_names,
    masked_mean,
    masked_min_max,
    stats_table_markdown,
)

DOC = Path(__file__).resolve().parents[3] / "docs" / "algorithms.md"


def test_docs_table_is_the_module_table() -> None:
    text = DOC.read_text()
    begin, end = "<!-- stats-table:begin -->\n", "\n<!-- stats-table:end -->"
    table = text[text.index(begin) + len(begin) : text.index(end)]
    assert table == stats_table_markdown(), "docs/algorithms.md stats table is out of date"
    tokens = {**ACTOR_TOKEN_STATS, **CRITIC_TOKEN_STATS}
    for name in STATS:
        base, _, red = name.rpartition("/")
        if base in tokens and red in ("avg", "min", "max"):
            assert f"`{base}/{{avg,min,max}}`" in table  # one row for the three reductions
        elif not name.startswith("prox_approx/"):
            assert f"`{name}`" in table


def test_issue_names_are_all_documented() -> None:
    # AReaL's per-token statistics are reported as <name>/avg, /min, /max
    # (areal/trainer/ppo/actor.py grpo_loss_fn; areal/utils/stats_tracker.py AVG_MIN_MAX)
    per_token = {
        f"{n}/{r}"
        for n in ("importance_weight", "behave_imp_weight", "behave_approx_kl", "clip_ratio",
                  "dual_clip_ratio", "approx_kl", "entropy", "behave_filtered_ratio")
        for r in ("avg", "min", "max")
    }  # fmt: skip
    required = per_token | {
        "no_eos_ratio", "seq_len", "prompt_len",
        "task_reward", "correct_n_seqs", "incorrect_n_seqs", "advantages", "kl_rewards",
        "rs_filtered_fraction", "m2po_masked_fraction",
        "dynamic_filter_dropped_fraction", "staleness_avg", "staleness_min", "staleness_max",
        "prox_approx/loglinear/logp_abs_error", "prox_approx/rollout/importance_weight_sq_error",
    }  # fmt: skip
    assert required <= set(STATS)
    with pytest.raises(KeyError, match="undocumented stat names"):
        check_stat_names({"made_up": torch.tensor(0.0)})


def test_masked_reductions() -> None:
    x = torch.tensor([[1.0, float("nan"), 3.0]])
    m = torch.tensor([[True, False, True]])
    assert masked_mean(x, m).item() == 2.0  # NaN off the mask never leaks
    assert masked_mean(x, torch.zeros_like(m)).item() == 0.0
    lo, hi = masked_min_max(x, m)
    assert (lo.item(), hi.item()) == (1.0, 3.0)


def test_public_api_names_resolve() -> None:
    for name in algorithms.__all__:
        assert getattr(algorithms, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        algorithms.nope  # noqa: B018
