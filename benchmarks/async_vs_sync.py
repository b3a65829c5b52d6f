"""Asynchronous vs synchronous RL through the real services, same trained samples.

Both runs use `flywheel run` on the same small configuration; only
`rollout.max_head_offpolicyness` differs (η = 0 is the synchronous baseline). Rollout and
trainer are pinned to separate cores with `taskset`, as separate GPU pools would be, so the
best overlap can do is turn `t_gen + t_train` into `max(t_gen, t_train)` — measured from the
synchronous run's own phase times. Prints one JSON line.

`t_gen` is the synchronous trainer's total wait for batches: generation plus everything
between a weight push and the next full batch (the rollout loading the weights, reward
scoring, put, the claim's poll). The asynchronous run hides those latencies as well, and its
rollout decodes larger continuous batches, so `overlap_efficiency` can exceed 1: the bound
is computed from what the synchronous run spends, not from pure decoding time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent


def config(root: Path, eta: int, steps: int, hidden: int, batch: int, samples: int) -> Path:
    cores = os.cpu_count() or 1
    cfg: dict[str, Any] = {
        "experiment_name": "bench",
        "trial_name": f"eta{eta}",
        "seed": 1,
        "total_train_steps": steps,
        "cluster": {"fileroot": str(root)},
        "launcher": {
            "tiny_model": {"hidden_size": hidden, "num_layers": 2, "num_heads": 4},
            "warm_start": {"enabled": True, "steps": 400, "batch_size": 128},
            "eval": {"freq_steps": 0, "n_prompts": 64},
            "progress": False,
            "rollout_cpus": [0] if cores > 1 else None,
            "trainer_cpus": [1] if cores > 1 else None,
        },
        "train_dataset": {"builtin": "arithmetic", "builtin_size": 4000},
        "valid_dataset": {"builtin": "arithmetic", "builtin_size": 64, "shuffle": False},
        "gconfig": {"n_samples": samples, "max_new_tokens": 12, "temperature": 1.0},
        "rollout": {
            "consumer_batch_size": batch,
            "max_head_offpolicyness": eta,
            "max_concurrent_rollouts": batch,
        },
        "reward": {"fn": "gsm8k", "num_workers": 1},
        "actor": {
            "group_size": samples,
            "ppo_n_minibatches": 1,
            "kl_ctl": 0.0,
            "dtype": "float32",
            "use_decoupled_loss": True,
            "recompute_logprob": True,
            "adv_norm": {
                "mean_level": "group",
                "std_level": "group",
                "eps": 1e-4,
                "group_size": samples,
            },
            "optimizer": {
                "lr": 5e-4,
                "warmup_steps": 5,
                "weight_decay": 0.0,
                "lr_scheduler_type": "constant",
            },
        },
        "trainer": {"n_ranks": 1, "save_freq_steps": None, "weight_transport": "disk"},
    }
    path = root / f"eta{eta}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_once(path: Path, root: Path, eta: int) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "run", "--config", str(path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=3600,
    )
    run_dir = root / "bench" / f"eta{eta}"
    if proc.returncode != 0:
        raise SystemExit(f"run eta={eta} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    summary = json.loads((run_dir / "summary.json").read_text())
    if not records or "phase_seconds" not in records[0]:
        raise SystemExit(f"run eta={eta}: the trainer's records carry no phase_seconds")
    phases = [r["phase_seconds"] for r in records]
    # The window from the start of the first step's wait to the end of the last step.
    start = records[0]["wall_time"] - records[0]["step_seconds"] - phases[0].get("wait_batch", 0)
    return {
        "wall": records[-1]["wall_time"] - start,
        "t_wait": sum(p.get("wait_batch", 0.0) for p in phases),
        "t_train": sum(r["step_seconds"] for r in records),  # everything but the wait
        "final_reward": sum(r.get("task_reward") or 0.0 for r in records[-3:])
        / min(3, len(records)),
        "max_staleness": summary["max_staleness_seen"],
        "samples": sum(r.get("samples", 0) for r in records),
        "invariants_ok": summary["invariants_ok"],
        "steps": len(records),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--eta", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="flywheel-bench-") as tmp:
        root = Path(tmp)
        sync = run_once(config(root, 0, args.steps, args.hidden, args.batch, args.samples), root, 0)
        asyn = run_once(
            config(root, args.eta, args.steps, args.hidden, args.batch, args.samples),
            root,
            args.eta,
        )
    # In the synchronous run the trainer waits exactly while the rollout generates.
    t_gen, t_train = sync["t_wait"], sync["t_train"]
    if t_gen + t_train <= 0:
        raise SystemExit("the synchronous run recorded no phase times (phase_seconds)")
    ideal = (t_gen + t_train) / max(t_gen, t_train)
    speedup = sync["wall"] / max(asyn["wall"], 1e-9)
    print(
        json.dumps(
            {
                "bench": "async_vs_sync",
                "steps": args.steps,
                "samples_per_run": sync["samples"],
                "sync_wall_seconds": round(sync["wall"], 2),
                "async_wall_seconds": round(asyn["wall"], 2),
                "speedup": round(speedup, 3),
                "t_gen_seconds": round(t_gen, 2),
                "t_train_seconds": round(t_train, 2),
                "ideal_speedup": round(ideal, 3),
                "overlap_efficiency": round(speedup / ideal, 3),
                "eta": args.eta,
                "max_staleness_seen": asyn["max_staleness"],
                "sync_max_staleness_seen": sync["max_staleness"],
                "final_reward_sync": round(sync["final_reward"], 3),
                "final_reward_async": round(asyn["final_reward"], 3),
                "invariants_ok": sync["invariants_ok"] and asyn["invariants_ok"],
                "cores": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
