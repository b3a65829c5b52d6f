"""Asynchronous vs synchronous RL over several seeds: accuracy per sample and time to target.

Each arm is one configuration (`--config`, default the demo's examples/demo.yaml) with one
staleness bound η
(`rollout.max_head_offpolicyness`) and one `actor.prox_logp_method`; η = 0 is the
synchronous baseline. Every arm runs once per seed (`--seeds`, the same seeds for every
arm, seed-major so slow phases of a shared machine fall on every arm alike), `--max-steps`
trainer steps each, with rollout and trainer pinned to separate cores (`taskset`), as
separate GPU pools would be. All runs share one data set (the demo's arithmetic splits, or
the config's files) and one starting model (the demo's warm start, trained once, or the
config's `actor.path`); the seed sets the run's data order and sampling. Every arm keeps the
config's learning-rate schedule (over its `total_train_steps`) whatever `--max-steps` is.

Evaluation is not done during the runs. Every run keeps each published weight version
(`trainer.keep_weight_versions`), and after it ends `version_eval.py` scores versions 0,
`--eval-every`, 2·`--eval-every`, ... on the `--eval-prompts` held-out prompts (T = 1, one
sample each, the same sampling seeds for every arm; a split smaller than `--eval-prompts` is
cycled, each repeat with its own seed), so "step N" is exactly version N in every arm and the
evaluations cost the runs nothing. A kept run holds only the versions it was scored at.

Per arm the JSON line gives, at each evaluated version: trained samples, seconds since the
rollout service was ready, and the accuracy's mean with its 95 % t interval over seeds
(`ci95.py`); against the baseline, the paired accuracy difference per version with its
interval and whether the arm's mean lies inside the baseline's interval at every evaluation
(`within_baseline_interval`); per seed the time to `--target` (linear interpolation between
the two evaluations around the first crossing) and the speed-up = baseline time / arm time
with its interval; the mean seconds per step, staleness, behaviour-weight statistics and
the share of tokens rejected (`rs_filtered_fraction`). A speed-up counts only for seeds where
both runs reached the target (`speedup_seeds`).

    python benchmarks/async_vs_sync.py                          # sync vs η = 2, 3 seeds
    python benchmarks/async_vs_sync.py --etas 0 1 2 4 8 --prox-methods recompute loglinear
    python benchmarks/async_vs_sync.py --config examples/smollm2_math.yaml --target 0.8 \
        --max-steps 20 --eval-prompts 160

Prints one JSON line and draws accuracy against trained samples and against seconds for
every arm (`--plot`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ci95 import mean_ci  # noqa: E402
from version_eval import score_versions  # noqa: E402

from services.common.model_source import resolve_model_path  # noqa: E402
from services.doctor.evidence import read_jsonl  # noqa: E402
from services.rollout.data import arithmetic  # noqa: E402
from services.rollout.data.arithmetic import write_jsonl  # noqa: E402
from services.trainer.weight_sync import published_versions  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "examples" / "demo.yaml"
DEFAULT_TARGET = 0.6
"""Held-out accuracy (T = 1) to time; the demo starts near 0.2 and passes 0.6 in its first
30-50 steps."""
LOSS_STATS = (
    "behave_imp_weight/avg",
    "behave_imp_weight/max",
    "behave_approx_kl/avg",
    "rs_filtered_fraction",
    "clip_ratio/avg",
    "importance_weight/avg",
    "staleness_avg",
)


PROX_METHODS = ("recompute", "loglinear", "linear", "metrics")


@dataclass(frozen=True)
class Arm:
    eta: int
    prox: str

    @property
    def name(self) -> str:
        return f"eta{self.eta}-{self.prox}"


def arms_of(etas: list[int], methods: list[str]) -> list[Arm]:
    """Every η × method; η = 0 once, with the first method (without staleness π_prox is the
    behaviour policy whichever way it is obtained)."""
    out: list[Arm] = []
    for eta in etas:
        for i, m in enumerate(methods):
            if eta == 0 and i > 0:
                continue
            out.append(Arm(eta, m))
    return out


def parse_arm(spec: str) -> Arm:
    """`ETA:METHOD` (e.g. `8:loglinear`), for sweeps that need only some combinations."""
    eta, sep, method = spec.partition(":")
    if not sep or not eta.isdigit() or method not in PROX_METHODS:
        raise SystemExit(
            f"--arms {spec!r}: write ETA:METHOD, METHOD one of {', '.join(PROX_METHODS)}"
        )
    return Arm(int(eta), method)


def write_data(root: Path, config: Path, seed: int = 1) -> tuple[Path, Path]:
    """The config's splits: the built-in arithmetic ones (the demo's, its seed 1) written
    once and shared by every run, or the config's own files."""
    cfg = yaml.safe_load(config.read_text())
    if cfg["train_dataset"].get("builtin") != "arithmetic":
        return (ROOT / cfg["train_dataset"]["path"], ROOT / cfg["valid_dataset"]["path"])
    train, valid = root / "data" / "train.jsonl", root / "data" / "valid.jsonl"
    write_jsonl(
        train, arithmetic.generate_split("train", cfg["train_dataset"]["builtin_size"], seed=seed)
    )
    write_jsonl(
        valid, arithmetic.generate_split("valid", cfg["valid_dataset"]["builtin_size"], seed=seed)
    )
    return train, valid


def run_config(root: Path, arm: Arm, seed: int, train: Path, args: argparse.Namespace) -> Path:
    cfg: dict[str, Any] = yaml.safe_load(args.config.read_text())
    schedule_steps = cfg["total_train_steps"]
    cores = os.cpu_count() or 1
    cfg.update(
        experiment_name="bench",
        trial_name=f"{arm.name}-s{seed}",
        total_train_steps=args.max_steps,
        seed=seed,
    )
    cfg["cluster"] = {"fileroot": str(root)}
    cfg["train_dataset"] = {"path": str(train), "type": "rl"}
    cfg["valid_dataset"] = None  # scored afterwards on fixed versions (version_eval.py)
    launcher = cfg.setdefault("launcher", {})
    launcher["progress"] = False
    launcher["rollout_cpus"] = [0] if cores > 1 else None
    launcher["trainer_cpus"] = [1] if cores > 1 else None
    cfg["rollout"]["max_head_offpolicyness"] = arm.eta
    cfg["actor"]["prox_logp_method"] = arm.prox
    trainer = cfg["trainer"]
    trainer["save_freq_steps"] = None
    trainer["lr_schedule_steps"] = schedule_steps
    trainer["keep_weight_versions"] = args.max_steps + 1
    for item in args.set or []:
        apply_override(cfg, item)
    path = root / f"{arm.name}-s{seed}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def apply_override(cfg: dict[str, Any], item: str) -> None:
    """`a.b.c=value` (the value read as YAML) into the config of every arm."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise SystemExit(f"--set {item!r}: write it as dotted.key=value")
    *parents, leaf = key.split(".")
    node = cfg
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = yaml.safe_load(raw)


def rollout_ready_time(run_dir: Path) -> float:
    """When the rollout service reported serving: every arm's clock starts there, so the
    batches generated before the trainer was up count for every arm alike."""
    for line in (run_dir / "logs" / "rollout-0.log").read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("msg") == "rollout serving":
            return float(rec["ts"])
    raise SystemExit(f"{run_dir}: the rollout log has no 'rollout serving' line")


def crossing(xs: list[float], ys: list[float], target: float) -> float | None:
    """The x where the piecewise-linear curve first reaches `target` after its start."""
    for k in range(1, len(ys)):
        if ys[k] >= target:
            if ys[k - 1] >= target or ys[k] == ys[k - 1]:
                return xs[k]
            frac = (target - ys[k - 1]) / (ys[k] - ys[k - 1])
            return xs[k - 1] + frac * (xs[k] - xs[k - 1])
    return None


def run_once(
    root: Path,
    arm: Arm,
    seed: int,
    train: Path,
    valid_rows: list[dict[str, Any]],
    model: Path | None,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One run to `--max-steps`, then its fixed-version evaluation. A finished run of the
    same config already in `root` (`--keep`) is evaluated again, not run again."""
    path = root / f"{arm.name}-s{seed}.yaml"
    before = path.read_text() if path.exists() else None
    run_dir = root / "bench" / f"{arm.name}-s{seed}"
    done = read_jsonl(run_dir / "metrics.jsonl") if run_dir.exists() else []
    path = run_config(root, arm, seed, train, args)
    if before == path.read_text() and done and done[-1]["step"] >= args.max_steps:
        print(f"{arm.name} seed {seed}: reusing the finished run in {run_dir}", file=sys.stderr)
        return evaluate_run(path, run_dir, seed, valid_rows, args)
    if run_dir.exists():
        shutil.rmtree(run_dir)  # an unfinished or differently configured run
    if model is not None:
        shutil.copytree(model, run_dir / "model")
    # PYTHONPATH: the services of this checkout, whatever the environment has installed.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    log_path = root / f"{arm.name}-s{seed}.log"
    with log_path.open("w") as log:
        proc = subprocess.run(
            [sys.executable, "-m", "services.cli", "run", "--config", str(path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            timeout=args.run_timeout,
            check=False,
        )
    records = read_jsonl(run_dir / "metrics.jsonl")
    if proc.returncode != 0 or not records or records[-1]["step"] < args.max_steps:
        tail = log_path.read_text()[-3000:]
        raise SystemExit(f"run {arm.name} seed {seed} failed ({proc.returncode}):\n{tail}")
    prune_versions(run_dir / "weights", set(eval_versions(args)))
    return evaluate_run(path, run_dir, seed, valid_rows, args)


def eval_versions(args: argparse.Namespace) -> list[int]:
    return sorted({0, *range(args.eval_every, args.max_steps + 1, args.eval_every), args.max_steps})


def prune_versions(weight_dir: Path, keep: set[int]) -> None:
    """Delete the published versions that will not be scored: a SmolLM2 version is 538 MB."""
    for v, d in published_versions(weight_dir).items():
        if v not in keep:
            shutil.rmtree(d)


def start_model(run_dir: Path, cfg: dict[str, Any]) -> Path:
    """The weights version 0 is: the run's warm start, or the config's model."""
    sft = run_dir / "model" / "sft"
    return sft if sft.is_dir() else Path(resolve_model_path(cfg["actor"]["path"]))


def eval_rows(rows: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """`n` rows: the first `n`, or the split cycled (each repeat samples with its own seed)."""
    if not rows:
        raise SystemExit("the held-out split is empty")
    return (rows * math.ceil(n / len(rows)))[:n]


def evaluate_run(
    path: Path,
    run_dir: Path,
    seed: int,
    valid_rows: list[dict[str, Any]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Score a finished run's published versions and read its records."""
    records = read_jsonl(run_dir / "metrics.jsonl")
    t0 = rollout_ready_time(run_dir)
    by_step = {int(r["step"]): r for r in records}
    versions = eval_versions(args)
    cfg = yaml.safe_load(path.read_text())
    scores = score_versions(
        start_model(run_dir, cfg),
        run_dir / "weights",
        versions,
        valid_rows,
        reward_fn=cfg["reward"]["fn"],
        temperature=cfg["gconfig"]["temperature"],
        max_new_tokens=cfg["gconfig"]["max_new_tokens"],
        seed=args.eval_seed,
    )
    samples_at, total = {0: 0}, 0
    for step in sorted(by_step):
        total += int(by_step[step].get("samples", 0))
        samples_at[step] = total
    curve = [
        {
            "version": s.version,
            "samples": samples_at[s.version],
            "seconds": 0.0 if s.version == 0 else round(by_step[s.version]["wall_time"] - t0, 2),
            "accuracy": s.accuracy,
        }
        for s in scores
    ]
    accs = [c["accuracy"] for c in curve]
    walls = [float(by_step[s]["wall_time"]) for s in sorted(by_step)]
    stats = {
        k: [float(r["stats"][k]) for r in records if k in r.get("stats", {})] for k in LOSS_STATS
    }
    return {
        "seed": seed,
        "curve": curve,
        "seconds_to_target": crossing([c["seconds"] for c in curve], accs, args.target),
        "samples_to_target": crossing([float(c["samples"]) for c in curve], accs, args.target),
        "seconds_per_step": (walls[-1] - walls[0]) / max(1, len(walls) - 1),
        "first_step_seconds": round(walls[0] - t0, 2),
        "staleness_max": max(float(r.get("staleness_max", 0)) for r in records),
        "stats": {k: statistics.fmean(v) for k, v in stats.items() if v},
        "behave_imp_weight_max": max(stats["behave_imp_weight/max"], default=None),
    }


def _round(x: Any, nd: int = 4) -> Any:
    if isinstance(x, float):
        return round(x, nd) if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _round(v, nd) for k, v in x.items()}
    if isinstance(x, list):
        return [_round(v, nd) for v in x]
    return x


def summarise(runs: list[dict[str, Any]], base: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Across seeds: the curve with intervals, and the comparison with the baseline arm's
    runs of the same seeds (`base`; None for the baseline itself)."""
    by_seed = {r["seed"]: r for r in runs}
    base_by_seed = {r["seed"]: r for r in base} if base is not None else {}
    versions = [c["version"] for c in runs[0]["curve"]]
    curve = []
    for k, v in enumerate(versions):
        point: dict[str, Any] = {
            "version": v,
            "samples": statistics.fmean(r["curve"][k]["samples"] for r in runs),
            "seconds": statistics.fmean(r["curve"][k]["seconds"] for r in runs),
            "accuracy": mean_ci([r["curve"][k]["accuracy"] for r in runs]),
        }
        if base is not None:
            diffs = [
                by_seed[s]["curve"][k]["accuracy"] - base_by_seed[s]["curve"][k]["accuracy"]
                for s in by_seed
                if s in base_by_seed
            ]
            point["accuracy_minus_baseline"] = mean_ci(diffs)
        curve.append(point)
    out: dict[str, Any] = {
        "curve": curve,
        "seconds_per_step": mean_ci([r["seconds_per_step"] for r in runs]),
        "staleness_max": max(r["staleness_max"] for r in runs),
        "behave_imp_weight_max": max((r["behave_imp_weight_max"] or 1.0) for r in runs),
        "stats": {
            k: statistics.fmean(r["stats"][k] for r in runs if k in r["stats"])
            for k in LOSS_STATS
            if any(k in r["stats"] for r in runs)
        },
        "per_seed": [
            {
                k: r[k]
                for k in (
                    "seed",
                    "seconds_to_target",
                    "samples_to_target",
                    "seconds_per_step",
                    "first_step_seconds",
                )
            }
            | {"accuracy": [c["accuracy"] for c in r["curve"]]}
            for r in runs
        ],
        "reached_target": sum(r["seconds_to_target"] is not None for r in runs),
    }
    if base is not None:
        base_curve = summarise(base, None)["curve"]
        out["within_baseline_interval"] = all(
            b["accuracy"]["low"] is None
            or b["accuracy"]["low"] <= p["accuracy"]["mean"] <= b["accuracy"]["high"]
            for p, b in zip(curve[1:], base_curve[1:], strict=True)
        )
        pairs = [
            (base_by_seed[s], r)
            for s, r in by_seed.items()
            if s in base_by_seed and r["seconds_to_target"] and base_by_seed[s]["seconds_to_target"]
        ]
        speedups = [b["seconds_to_target"] / r["seconds_to_target"] for b, r in pairs]
        out["speedup"] = mean_ci(speedups)
        out["speedup_geometric_mean"] = (
            math.exp(statistics.fmean(math.log(x) for x in speedups)) if speedups else None
        )
        out["speedup_seeds"] = len(speedups)
        out["samples_to_target_ratio"] = mean_ci(
            [r["samples_to_target"] / b["samples_to_target"] for b, r in pairs]
        )
        out["seconds_per_step_ratio"] = mean_ci(
            [
                base_by_seed[s]["seconds_per_step"] / r["seconds_per_step"]
                for s, r in by_seed.items()
                if s in base_by_seed
            ]
        )
    return out


def plot(path: Path, arms: dict[str, dict[str, Any]], target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for name, summary in arms.items():
        pts = summary["curve"]
        mean = [p["accuracy"]["mean"] for p in pts]
        low = [
            p["accuracy"]["low"] if p["accuracy"]["low"] is not None else p["accuracy"]["mean"]
            for p in pts
        ]
        high = [
            p["accuracy"]["high"] if p["accuracy"]["high"] is not None else p["accuracy"]["mean"]
            for p in pts
        ]
        for ax, key in zip(axes, ("samples", "seconds"), strict=True):
            xs = [p[key] for p in pts]
            (line,) = ax.plot(xs, mean, marker="o", markersize=3, label=name)
            ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.15)
    for ax, label in zip(
        axes, ("trained samples", "seconds since the rollout service was ready"), strict=True
    ):
        ax.axhline(target, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out accuracy (T = 1)")
    fig.suptitle("mean over seeds, shaded: 95 % interval", fontsize=10)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=DEMO, help="the arms' base config")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--etas", type=int, nargs="+", default=[0, 2])
    parser.add_argument(
        "--prox-methods",
        nargs="+",
        default=["recompute"],
        choices=PROX_METHODS,
    )
    parser.add_argument(
        "--arms",
        nargs="+",
        metavar="ETA:METHOD",
        help="exactly these arms (e.g. 0:recompute 8:loglinear) instead of --etas x --prox-methods",
    )
    parser.add_argument("--target", type=float, default=DEFAULT_TARGET)
    parser.add_argument("--max-steps", type=int, default=50)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-prompts", type=int, default=500)
    parser.add_argument("--eval-seed", type=int, default=0, help="sampling seeds of the evaluation")
    parser.add_argument("--run-timeout", type=float, default=1800.0)
    parser.add_argument("--plot", type=Path, default=Path("async_vs_sync.png"))
    parser.add_argument(
        "--warm-model",
        type=Path,
        default=None,
        help="the model cache of an earlier demo run (<run>/model with base/ and "
        "sft/): every run starts from it instead of training the warm start",
    )
    parser.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="a dotted config override for every arm (e.g. actor.optimizer.lr=2e-4); repeatable",
    )
    parser.add_argument("--keep", type=Path, default=None, help="keep the runs in this directory")
    args = parser.parse_args()
    args.config = args.config.resolve()
    arms = [parse_arm(a) for a in args.arms] if args.arms else arms_of(args.etas, args.prox_methods)
    start = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="flywheel-bench-") if args.keep is None else None
    root = Path(tmp) if tmp else args.keep.resolve()
    root.mkdir(parents=True, exist_ok=True)
    try:
        train, valid = write_data(root, args.config)
        valid_rows = eval_rows(read_jsonl(valid), args.eval_prompts)
        model = args.warm_model
        runs: dict[str, list[dict[str, Any]]] = {a.name: [] for a in arms}
        for seed in args.seeds:
            for arm in arms:
                runs[arm.name].append(run_once(root, arm, seed, train, valid_rows, model, args))
                made = root / "bench" / f"{arm.name}-s{seed}" / "model"
                model = made if made.is_dir() else model  # a warm start, trained once
                print(f"{arm.name} seed {seed}: {runs[arm.name][-1]['curve']}", file=sys.stderr)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    # η = 0 is the baseline every other arm is compared with (no comparison without it).
    baseline = next((a.name for a in arms if a.eta == 0), None)
    summaries = {
        a.name: summarise(runs[a.name], None if baseline in (None, a.name) else runs[baseline])
        for a in arms
    }
    plot(args.plot, summaries, args.target)
    print(
        json.dumps(
            _round(
                {
                    "bench": "async_vs_sync",
                    "config": str(args.config),
                    "baseline": baseline,
                    "seeds": args.seeds,
                    "target_accuracy": args.target,
                    "max_steps": args.max_steps,
                    "eval_every_steps": args.eval_every,
                    "eval_prompts": len(valid_rows),
                    "arms": summaries,
                    "plot": str(args.plot),
                    "elapsed_seconds": time.monotonic() - start,
                    "cores": os.cpu_count(),
                    "load_average_1m": os.getloadavg()[0],
                }
            )
        )
    )


if __name__ == "__main__":
    main()
