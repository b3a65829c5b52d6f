"""What a local run prepares before any service starts: run directory, model, data, ports.

Services only ever read files and a resolved config, so everything generated (the tiny
model, its warm start, the arithmetic data set, free ports) is produced here once and
written down in `<run_dir>/config.yaml` for every service to load.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import yaml

from services.common.config import FlywheelConfig
from services.common.redis_server import free_port

PREVIOUS_RUN_LEFTOVERS = (
    "checkpoints",
    "logs",
    "redis",
    "weights",
    "metrics.jsonl",
    "summary.json",
    "learning_curve.png",
    "evals.jsonl",
    "services.json",
)


def run_dir_of(cfg: FlywheelConfig) -> Path:
    return (Path(cfg.cluster.fileroot) / cfg.experiment_name / cfg.trial_name).resolve()


def reset_if_finished(run_dir: Path) -> bool:
    """A finished run (summary written) is cleared so the next one starts fresh; an
    unfinished one is kept so `trainer.recover: auto` can resume it. The model cache stays."""
    if not (run_dir / "summary.json").exists():
        return False
    for name in PREVIOUS_RUN_LEFTOVERS:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink()
    return True


def prepare_data(cfg: FlywheelConfig, run_dir: Path) -> None:
    """Generate the built-in arithmetic splits when the datasets name no file."""
    from services.rollout.data import arithmetic
    from services.rollout.data.arithmetic import write_jsonl

    if cfg.train_dataset.path is None:
        path = run_dir / "data" / "train.jsonl"
        if not path.exists():
            write_jsonl(
                path,
                arithmetic.generate_split("train", cfg.train_dataset.builtin_size, seed=cfg.seed),
            )
        cfg.train_dataset.path = str(path)
    if cfg.valid_dataset is not None and cfg.valid_dataset.path is None:
        path = run_dir / "data" / "valid.jsonl"
        if not path.exists():
            write_jsonl(
                path,
                arithmetic.generate_split("valid", cfg.valid_dataset.builtin_size, seed=cfg.seed),
            )
        cfg.valid_dataset.path = str(path)


def prepare_model(cfg: FlywheelConfig, run_dir: Path, log: Any = print) -> None:
    """Write the tiny model (and its supervised warm start) when `actor.path` is empty."""
    from services.common.tiny_model import write_tiny_model

    if cfg.actor.path:
        from services.common.model_source import resolve_config_sources

        resolve_config_sources(cfg)  # GGUF sources: converted once, before any service starts
        return
    tm = cfg.launcher.tiny_model
    base = write_tiny_model(
        run_dir / "model" / "base",
        hidden_size=tm.hidden_size,
        num_layers=tm.num_layers,
        num_heads=tm.num_heads,
        seed=tm.seed,
    )
    path = base
    ws = cfg.launcher.warm_start
    if ws.enabled and ws.steps > 0:
        sft = run_dir / "model" / "sft"
        if not (sft / "warm_start.json").exists():
            from services.launcher.warmstart import warm_start
            from services.rollout.data.datasets import read_rows

            rows = read_rows(cfg.train_dataset.path)  # type: ignore[arg-type]
            log(f"warm start: {ws.steps} supervised steps on {len(rows)} prompts")
            stats = warm_start(
                base, sft, rows, ws, prompt_key=cfg.train_dataset.prompt_key, log=log
            )
            log(
                f"warm start done in {stats['warm_start_seconds']:.1f}s, loss {stats['warm_start_loss']:.4f}"
            )
        path = sft
    cfg.actor.path = str(path)
    if cfg.critic is not None and not cfg.critic.path:
        cfg.critic.path = str(path)
    if cfg.ref is not None and not cfg.ref.path:
        cfg.ref.path = str(path)
    if not cfg.tokenizer_path:
        cfg.tokenizer_path = str(path)


def _free_block(n: int) -> int:
    """A port p with p..p+n-1 all free (rollout replicas use consecutive ports)."""
    for _ in range(100):
        p = free_port()
        if all(_is_free(p + i) for i in range(1, n)):
            return p
    raise RuntimeError(f"no block of {n} free ports")


def _is_free(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def assign_ports(cfg: FlywheelConfig) -> None:
    """Concrete ports for every endpoint left at 0."""
    replicas = cfg.rollout.n_replicas
    for name in ("buffer", "reward", "rollout", "trainer"):
        ep = getattr(cfg.services, name)
        n = replicas if name == "rollout" else 1
        if name == "rollout":
            ep.port_stride = 1
        if ep.port == 0:
            ep.port = _free_block(n)
        if ep.metrics_port == 0:
            ep.metrics_port = _free_block(n)


def resolve_run_paths(cfg: FlywheelConfig, run_dir: Path) -> None:
    """Write the run directory's default paths into the config, so every service (not only
    the one that owns a path) finds checkpoints, published weights and metrics in one place:
    a restarted rollout replica loads the newest published weights from `weight_dir`."""
    t = cfg.trainer
    t.checkpoint_dir = t.checkpoint_dir or str(run_dir / "checkpoints")
    t.weight_dir = t.weight_dir or str(run_dir / "weights")
    t.metrics_jsonl = t.metrics_jsonl or str(run_dir / "metrics.jsonl")


def write_resolved_config(cfg: FlywheelConfig, run_dir: Path) -> Path:
    path = run_dir / "config.yaml"
    data = cfg.model_dump(mode="json")
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path
