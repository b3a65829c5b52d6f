"""`async_vs_sync`'s arithmetic: the target crossing, the arms, and the summary over seeds.

Worked cases by hand (the arithmetic in the comments); the t quantile 4.303 for 3 seeds is
Student's (checked in test_ci95.py).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from async_vs_sync import (  # noqa: E402
    ROOT,
    Arm,
    arms_of,
    crossing,
    eval_rows,
    parse_arm,
    prune_versions,
    summarise,
    write_data,
)

from services.trainer.weight_sync import version_dir  # noqa: E402


def test_crossing_interpolates_between_the_two_evaluations_around_it() -> None:
    # 0.5 at x=10, 0.7 at x=20: 0.6 is reached halfway, at x=15
    assert crossing([0, 10, 20], [0.2, 0.5, 0.7], 0.6) == pytest.approx(15.0)
    # the start does not count, even above the target
    assert crossing([0, 10], [0.9, 0.5], 0.6) is None
    assert crossing([0, 10, 20], [0.2, 0.6, 0.9], 0.6) == 10  # exactly at an evaluation
    assert crossing([0, 10, 20], [0.2, 0.5, 0.59], 0.6) is None


def test_eta_zero_runs_once_whatever_the_methods() -> None:
    assert arms_of([0, 2], ["recompute", "loglinear"]) == [
        Arm(0, "recompute"),
        Arm(2, "recompute"),
        Arm(2, "loglinear"),
    ]
    assert Arm(4, "loglinear").name == "eta4-loglinear"


def test_arm_specs_name_one_combination_each() -> None:
    assert parse_arm("8:loglinear") == Arm(8, "loglinear")
    for bad in ("8", "x:recompute", "2:nope", ":recompute"):
        with pytest.raises(SystemExit, match="ETA:METHOD"):
            parse_arm(bad)


def run(seed: int, accs: list[float], seconds: list[float], sps: float) -> dict[str, Any]:
    samples = [0, 512, 1024]
    curve = [
        {"version": v, "samples": n, "seconds": s, "accuracy": a}
        for v, n, s, a in zip((0, 1, 2), samples, seconds, accs, strict=True)
    ]
    return {
        "seed": seed,
        "curve": curve,
        "seconds_to_target": crossing(seconds, accs, 0.6),
        "samples_to_target": crossing([float(n) for n in samples], accs, 0.6),
        "seconds_per_step": sps,
        "first_step_seconds": seconds[1],
        "staleness_max": 2.0,
        "stats": {"rs_filtered_fraction": 0.01 * seed},
        "behave_imp_weight_max": 1.5,
    }


def test_summary_pairs_seeds_and_reports_the_speedup_interval() -> None:
    base = [run(s, [0.2, 0.5, 0.7], [0, 10, 20], 2.0) for s in (1, 2, 3)]
    # arm: the same accuracies, twice as fast for seeds 1-2, 4x for seed 3
    arm = [
        run(1, [0.2, 0.5, 0.7], [0, 5, 10], 1.0),
        run(2, [0.2, 0.5, 0.7], [0, 5, 10], 1.0),
        run(3, [0.2, 0.5, 0.7], [0, 2.5, 5], 0.5),
    ]
    out = summarise(arm, base)
    # speed-ups 15/7.5 = 2, 2, 15/3.75 = 4: mean 8/3; sd = sqrt(((2/3)^2*2 + (4/3)^2)/2)
    # = 1.1547; half = 4.303 * 1.1547 / sqrt(3) = 2.8687
    assert out["speedup"]["mean"] == pytest.approx(8 / 3)
    assert out["speedup"]["half_width"] == pytest.approx(2.8687, abs=1e-3)
    assert out["speedup_geometric_mean"] == pytest.approx((2 * 2 * 4) ** (1 / 3))
    assert out["speedup_seeds"] == 3
    assert out["samples_to_target_ratio"]["mean"] == pytest.approx(1.0)
    assert out["within_baseline_interval"] is True  # equal curves
    assert out["curve"][2]["accuracy_minus_baseline"]["mean"] == pytest.approx(0.0)
    assert out["stats"]["rs_filtered_fraction"] == pytest.approx(0.02)


def test_an_arm_below_the_baseline_interval_is_flagged_and_unreached_seeds_dropped() -> None:
    base = [run(s, [0.2, 0.5 + 0.01 * s, 0.7], [0, 10, 20], 2.0) for s in (1, 2, 3)]
    arm = [run(s, [0.2, 0.3, 0.55 + 0.1 * (s == 3)], [0, 5, 10], 1.0) for s in (1, 2, 3)]
    out = summarise(arm, base)
    assert out["within_baseline_interval"] is False
    assert out["reached_target"] == 1 and out["speedup_seeds"] == 1
    # seed 3 only: base crosses 0.6 between 0.53 (10 s) and 0.7 (20 s) at
    # 10 + 10 * 0.07 / 0.17 = 14.1176 s; the arm between 0.3 (5 s) and 0.65 (10 s) at
    # 5 + 5 * 0.3 / 0.35 = 9.2857 s: 14.1176 / 9.2857 = 1.5204, no interval from one seed
    assert out["speedup"]["mean"] == pytest.approx(1.520362, abs=1e-6)
    assert out["speedup"]["half_width"] is None


def test_a_small_split_is_cycled_to_the_evaluation_size() -> None:
    rows = [{"id": i} for i in range(3)]
    assert [r["id"] for r in eval_rows(rows, 7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [r["id"] for r in eval_rows(rows, 2)] == [0, 1]
    with pytest.raises(SystemExit, match="empty"):
        eval_rows([], 5)


def test_only_the_scored_versions_stay_on_disk(tmp_path: Path) -> None:
    # the directories the disk transport itself names (weight_sync.version_dir)
    for v in range(7):
        version_dir(tmp_path, v).mkdir(parents=True)
    (tmp_path / "notes").mkdir()  # not a version: left alone
    prune_versions(tmp_path, {0, 5, 6})
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [version_dir(tmp_path, v).name for v in (0, 5, 6)] + ["notes"]
    )


def test_a_config_with_its_own_files_uses_them(tmp_path: Path) -> None:
    train, valid = write_data(tmp_path, ROOT / "examples" / "smollm2_math.yaml")
    assert train == ROOT / "examples/data/smollm2_sums/train.jsonl" and train.is_file()
    assert valid == ROOT / "examples/data/smollm2_sums/valid.jsonl" and valid.is_file()
    assert not (tmp_path / "data").exists()  # nothing generated
    train, valid = write_data(tmp_path, ROOT / "examples" / "demo.yaml")
    assert train == tmp_path / "data" / "train.jsonl" and train.is_file()
    assert len(valid.read_text().splitlines()) == 500  # the demo's held-out split
