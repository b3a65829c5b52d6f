"""`flywheel doctor --experiments`: the runs it plans are valid configs, and its decision tree
follows AReaL's diagnosis guide (docs/en/best_practices/algo_perf.md, "Training Rewards Not
Increasing": synchronous RL rules out off-policyness; rewards rising on the test set but not
on the training set point at the data; not rising on the test set either at the
hyper-parameters or the model)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import load_config
from services.doctor.experiments import (
    Experiment,
    Outcome,
    decide,
    held_out_experiment,
    outcome,
    plan,
)
from tests.doctor.runs import config_yaml, make_run

DEMO = str(Path(__file__).resolve().parents[2] / "examples" / "demo.yaml")


def test_the_planned_runs_are_the_demo_async_and_synchronous(tmp_path: Path):
    fileroot = f"cluster.fileroot={tmp_path}"
    first, sync = plan(DEMO, [fileroot], steps=20)
    a = load_config(DEMO, first.overrides)
    s = load_config(DEMO, sync.overrides)
    assert (a.experiment_name, a.trial_name, a.total_train_steps) == ("demo-doctor", "async", 20)
    assert a.rollout.max_head_offpolicyness == 2 and a.actor.use_decoupled_loss
    # AReaL's switch to synchronous RL: eta 0, no recomputed log-probs, plain PPO loss
    assert s.rollout.max_head_offpolicyness == 0
    assert not s.actor.recompute_logprob and not s.actor.use_decoupled_loss
    assert a.actor.rejection_sampling is not None and s.actor.rejection_sampling is None
    assert first.run_dir == tmp_path / "demo-doctor" / "async"
    assert sync.run_dir == tmp_path / "demo-doctor" / "sync"


def test_the_test_set_run_trains_on_the_held_out_file_of_the_first(tmp_path: Path):
    valid = tmp_path / "valid.jsonl"
    valid.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    run_dir = tmp_path / "async"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(
        config_yaml(tmp_path, valid_dataset={"builtin": None, "path": str(valid)})
    )
    src = tmp_path / "src.yaml"
    exp = held_out_experiment(Experiment("async", ["trial_name=async"], run_dir))
    cfg = load_config(str(src), exp.overrides)
    assert cfg.train_dataset.path == str(valid) and cfg.train_dataset.builtin is None
    assert cfg.trial_name == "test_set" and exp.run_dir == tmp_path / "test_set"


def _o(name: str, rising: bool, base: float | None = 0.3) -> Outcome:
    return Outcome(name, Path(name), 0, rising, "", base, None, 100)


@pytest.mark.parametrize(
    ("a", "s", "t", "base", "branch"),
    [
        (True, True, True, 0.3, "none"),
        (False, True, False, 0.3, "off-policyness"),
        (False, False, True, 0.3, "data"),
        (False, False, False, 0.0, "model"),
        (False, False, False, 0.3, "hyper-parameters"),
    ],
)
def test_the_decision_tree(a, s, t, base, branch):
    d = decide(_o("async", a, base), _o("sync", s, base), _o("test_set", t, base))
    assert d.branch == branch
    assert [o.name for o in d.outcomes] == ["async", "sync", "test_set"]


def test_an_outcome_is_read_from_the_run_directory(tmp_path: Path):
    run = make_run(
        tmp_path,
        evals=[{"step": 0, "accuracy": 0.2, "n": 500}, {"step": 30, "accuracy": 0.4, "n": 500}],
    )
    o = outcome(Experiment("async", [], run), 0)
    assert o.rising and o.baseline_accuracy == 0.2 and o.final_accuracy == 0.4
    # 30 steps of 32 groups x 4 samples; (0.4 - 0.2) * 1000 / 3840
    assert o.samples == 30 * 128
    assert o.gain_per_1k_samples == pytest.approx(0.2 * 1000 / 3840, rel=1e-9)
