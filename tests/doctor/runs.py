"""Run directories as `flywheel run` leaves them, written by the tests from step records that
carry every key the trainer writes (services/trainer/step_report.py), so that each
doctor check can be tripped on purpose."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from services.common.config import load_config, to_yaml
from tests.run_configs import tiny_run_config

GROUPS = 32
"""Groups per step in the synthetic runs (a step's reward is known to +-0.09 at most)."""


def config_yaml(tmp_path: Path, **blocks: dict[str, Any]) -> str:
    """The resolved config a launcher writes, from the tiny run's plus `blocks`."""
    cfg = tiny_run_config(tmp_path / "runs", experiment="doctor", steps=30)
    cfg["rollout"]["consumer_batch_size"] = GROUPS
    for key, value in blocks.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    src = tmp_path / "src.yaml"
    src.write_text(yaml.safe_dump(cfg))
    return to_yaml(load_config(str(src)))


def record(step: int, rng: random.Random, **over: Any) -> dict[str, Any]:
    """A healthy step: one minibatch (importance weight exactly 1), behaviour weight near 1,
    no truncation, staleness within eta 1, every replica updated."""
    p = over.pop("p", 0.5)
    n_seqs = GROUPS * 4
    reward = sum(rng.random() < p for _ in range(n_seqs)) / n_seqs
    wait = over.pop("wait", 0.2)
    stats = {
        "task_reward": reward,
        "no_eos_ratio": 0.0,
        "seq_len": 20.0,
        "response_len": 6.0,
        "importance_weight/avg": 1.0,
        "importance_weight/max": 1.0,
        "behave_imp_weight/avg": 1.0 + rng.uniform(-0.01, 0.01),
        "behave_imp_weight/max": 1.3,
        "staleness_max": 1.0,
        "staleness_avg": 0.5,
        "n_seqs": float(n_seqs),
    }
    stats.update(over.pop("stats", {}))
    rec: dict[str, Any] = {
        "step": step,
        "version": step,
        "task_reward": stats["task_reward"],
        "staleness_max": stats["staleness_max"],
        "staleness_avg": stats["staleness_avg"],
        "importance_weight": stats["importance_weight/avg"],
        "behave_imp_weight": stats["behave_imp_weight/avg"],
        "no_eos_ratio": stats["no_eos_ratio"],
        "loss": 0.01,
        "losses": [0.01],
        "grad_norm": 0.5,
        "lr": 1e-4,
        "samples": n_seqs,
        "tokens": n_seqs * 20,
        "tokens_per_second": 1000.0,
        "skipped_updates": 0,
        "prox_forwards": 1,
        "step_seconds": 1.0,
        "phase_seconds": {"train": 0.8, "wait_batch": wait, "broadcast": 0.1},
        "group_ids": [f"g{step}-{i}" for i in range(GROUPS)],
        "staleness_per_seq": [0] * n_seqs,
        "stats": stats,
        "wall_time": 1.0e9 + step,
        "weight_broadcast_seconds": 0.1,
        "replicas_updated": 1,
        "replicas_failed": [],
    }
    rec.update(over)
    # the top-level copies follow the stats they mirror
    for key, stat in (
        ("task_reward", "task_reward"),
        ("importance_weight", "importance_weight/avg"),
        ("behave_imp_weight", "behave_imp_weight/avg"),
        ("no_eos_ratio", "no_eos_ratio"),
        ("staleness_max", "staleness_max"),
        ("staleness_avg", "staleness_avg"),
    ):
        rec[key] = stats[stat]
    return rec


def parity_line(version: int, **over: Any) -> dict[str, Any]:
    """One line of weight_parity.jsonl as services/trainer/parity.py writes it: a healthy
    float32 replica (the demo's measured differences are about 1e-5)."""
    line: dict[str, Any] = {
        "replica": "127.0.0.1:50100",
        "version": version,
        "max_abs_logprob_diff": 1.5e-5,
        "tolerance": 1e-3,
        "ok": True,
        "reason": "",
        "tokens": 24,
        "time": 1.0e9 + version,
    }
    line.update(over)
    return line


def make_run(
    tmp_path: Path,
    *,
    steps: int = 30,
    per_step: Callable[[int], dict[str, Any]] = lambda i: {"p": 0.3 + 0.4 * i / 30},
    config: dict[str, dict[str, Any]] | None = None,
    summary: dict[str, Any] | None | bool = True,
    evals: list[dict[str, Any]] | None = None,
    starvation: dict[str, Any] | None = None,
    restarts: list[dict[str, Any]] | None = None,
    parity: Callable[[int], dict[str, Any]] | None = lambda i: {},
    seed: int = 0,
) -> Path:
    """A run directory; `summary=True` writes a finished run's summary with a clean ledger."""
    run = tmp_path / "run"
    run.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    (run / "config.yaml").write_text(config_yaml(tmp_path, **(config or {})))
    records = [record(i, rng, **per_step(i)) for i in range(1, steps + 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if summary is True:
        put = GROUPS * steps
        summary = {
            "steps": steps,
            "eta": 1,
            "buffer": {
                "put_total": put,
                "acked_total": put,
                "dropped_total": {},
                "pending": 0,
                "in_flight": 0,
                "invariant_ok": True,
            },
            "restarts_total": 0,
            "restarts": [],
        }
    if summary:
        (run / "summary.json").write_text(json.dumps(summary))
    if evals:
        (run / "evals.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    if starvation is not None:
        (run / "starvation.json").write_text(json.dumps(starvation))
    if parity is not None:  # the trainer's probe of one replica after each update
        lines = [parity_line(i, **parity(i)) for i in range(1, steps + 1)]
        (run / "weight_parity.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    if restarts:
        (run / "restarts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in restarts))
    return run
