"""`flywheel doctor --config FILE --experiments`: the playbook's experiments as short runs,
and the branch of its decision tree the evidence points to.

Three runs of the same config, each kept under `<fileroot>/<experiment>-doctor/<name>`:

1. `async`: the config as given (its evaluation before training is the baseline);
2. `sync`: the same with `rollout.max_head_offpolicyness=0`,
   `actor.recompute_logprob=false`, `actor.use_decoupled_loss=false` (and no
   `actor.rejection_sampling`, which needs the decoupled loss);
3. `test_set`: the asynchronous run trained on the held-out data (`valid_dataset`).

`decide` reads the three outcomes (whether each one's reward rose, its held-out accuracy per
trained sample) and names a branch: `none` (the config learns), `off-policyness` (the
synchronous run learns, the asynchronous one does not), `data` (the test set is learnt, the
training set is not), `model` (nothing is learnt and the starting model scores about 0:
the task is beyond it) or `hyper-parameters` (nothing is learnt from a model that can
score).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.config import load_config
from services.doctor.checks import BASELINE_NEAR_ZERO, reward_trend
from services.doctor.evidence import gather

SYNC_OVERRIDES = (
    "rollout.max_head_offpolicyness=0",
    "actor.recompute_logprob=false",
    "actor.use_decoupled_loss=false",
    # rejection sampling filters on the decoupled loss's behaviour weight, which the
    # synchronous run no longer has (the config refuses the pair)
    "actor.rejection_sampling=null",
)


@dataclass
class Experiment:
    name: str
    overrides: list[str]
    run_dir: Path


@dataclass
class Outcome:
    name: str
    run_dir: Path
    exit_code: int
    rising: bool
    """The reward_trend check passed (held-out accuracy or task reward rose)."""
    trend: str
    baseline_accuracy: float | None = None
    final_accuracy: float | None = None
    samples: int = 0

    @property
    def gain_per_1k_samples(self) -> float | None:
        if self.baseline_accuracy is None or self.final_accuracy is None or not self.samples:
            return None
        return 1000.0 * (self.final_accuracy - self.baseline_accuracy) / self.samples


@dataclass
class Decision:
    branch: str
    because: str
    advice: str
    outcomes: list[Outcome] = field(default_factory=list)


def plan(config: str, overrides: list[str], steps: int | None) -> list[Experiment]:
    """The async and sync runs (the test-set run is planned once the async run has written
    the held-out data: `held_out_experiment`)."""
    cfg = load_config(config, overrides)
    if cfg.valid_dataset is None:
        raise ValueError("--experiments needs valid_dataset (the baseline and the test-set run)")
    exp = f"{cfg.experiment_name}-doctor"
    root = Path(cfg.cluster.fileroot).resolve() / exp
    base = [*overrides, f"experiment_name={exp}"]
    if steps is not None:
        base.append(f"total_train_steps={steps}")
    return [
        Experiment("async", [*base, "trial_name=async"], root / "async"),
        Experiment("sync", [*base, *SYNC_OVERRIDES, "trial_name=sync"], root / "sync"),
    ]


def held_out_experiment(first: Experiment) -> Experiment:
    """Train on the held-out file the first run used (its resolved config names it)."""
    cfg = load_config(str(first.run_dir / "config.yaml"))
    assert cfg.valid_dataset is not None and cfg.valid_dataset.path
    base = [o for o in first.overrides if not o.startswith("trial_name=")]
    return Experiment(
        "test_set",
        [
            *base,
            "trial_name=test_set",
            f"train_dataset.path={cfg.valid_dataset.path}",
            "train_dataset.builtin=null",
        ],
        first.run_dir.parent / "test_set",
    )


def outcome(exp: Experiment, exit_code: int) -> Outcome:
    ev = gather(exp.run_dir)
    trend = reward_trend(ev)
    evals = [e for e in ev.evals if e.get("accuracy") is not None]
    return Outcome(
        name=exp.name,
        run_dir=exp.run_dir,
        exit_code=exit_code,
        rising=trend.status == "pass",
        trend=f"{trend.status}: {trend.summary}",
        baseline_accuracy=float(evals[0]["accuracy"]) if evals else None,
        final_accuracy=float(evals[-1]["accuracy"]) if len(evals) > 1 else None,
        samples=sum(int(r.get("samples", 0) or 0) for r in ev.records),
    )


def decide(async_: Outcome, sync: Outcome, test_set: Outcome) -> Decision:
    """The playbook's decision tree over the three runs."""
    outcomes = [async_, sync, test_set]
    base = async_.baseline_accuracy
    if async_.rising:
        per = (
            f" (held-out gain per 1000 trained samples: async {_f(async_.gain_per_1k_samples)}, "
            f"sync {_f(sync.gain_per_1k_samples)})"
        )
        return Decision(
            "none",
            "the asynchronous run learns" + per,
            "no fault found in these runs; if the full run stalls later, run doctor on it",
            outcomes,
        )
    if sync.rising:
        return Decision(
            "off-policyness",
            "the synchronous run learns and the asynchronous one does not",
            "lower rollout.max_head_offpolicyness, set actor.rejection_sampling "
            "{level: token, action: mask, metric: ratio, upper: 5.0}",
            outcomes,
        )
    if test_set.rising:
        return Decision(
            "data",
            "RL on the test set learns, on the training set it does not",
            "inspect the training data: its difficulty for this model and its distribution "
            "against the test set; filter groups with equal rewards (buffer.filter)",
            outcomes,
        )
    if base is not None and base <= BASELINE_NEAR_ZERO:
        return Decision(
            "model",
            f"nothing is learnt, not even the test set, and the starting model scores {base:.3f}",
            "the task is beyond the model: fine-tune it first (SFT) or start from a stronger one",
            outcomes,
        )
    return Decision(
        "hyper-parameters",
        "nothing is learnt, not even the test set, from a model that can score"
        + (f" ({base:.3f})" if base is not None else ""),
        "raise rollout.consumer_batch_size, change actor.optimizer.lr, or train longer",
        outcomes,
    )


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.4f}"


def _acc(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _run(exp: Experiment, config: str) -> int:
    cmd = [sys.executable, "-m", "services.cli", "run", "--config", config, *exp.overrides]
    print(f"doctor --experiments: {exp.name}: {' '.join(cmd[3:])}", file=sys.stderr)
    return subprocess.run(cmd, check=False).returncode


def run_experiments(config: str, overrides: list[str], steps: int | None) -> Decision:
    first, sync = plan(config, overrides, steps)
    codes = {first.name: _run(first, config)}
    test_set = held_out_experiment(first)
    for exp in (sync, test_set):
        codes[exp.name] = _run(exp, config)
    return decide(*(outcome(e, codes[e.name]) for e in (first, sync, test_set)))


def render_decision(d: Decision) -> str:
    lines = []
    for o in d.outcomes:
        lines.append(
            f"{o.name:<8}  {o.run_dir}  exit {o.exit_code}; held-out {_acc(o.baseline_accuracy)}"
            f" -> {_acc(o.final_accuracy)} over {o.samples} trained samples; {o.trend}"
        )
    lines.append(f"branch: {d.branch}: {d.because}")
    lines.append(f"  -> {d.advice}")
    return "\n".join(lines)


def decision_dict(d: Decision) -> dict[str, Any]:
    return {
        "branch": d.branch,
        "because": d.because,
        "advice": d.advice,
        "runs": [
            {
                "name": o.name,
                "run_dir": str(o.run_dir),
                "exit_code": o.exit_code,
                "rising": o.rising,
                "trend": o.trend,
                "baseline_accuracy": o.baseline_accuracy,
                "final_accuracy": o.final_accuracy,
                "samples": o.samples,
                "gain_per_1k_samples": o.gain_per_1k_samples,
            }
            for o in d.outcomes
        ],
    }
