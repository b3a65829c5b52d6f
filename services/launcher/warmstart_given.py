"""The warm start of a given model: `flywheel sft` on rows a user's function writes.

The tiny demo model's warm start (`warmstart.py`) teaches `#### N` answers to a model the
launcher wrote itself. A run that names its own model may need a different lesson: the
tool-math agent's SmolLM2 never writes a tool call, so its RL starts from a few SFT steps
on call-format transcripts. `launcher.warm_start.rows_fn` names the function that turns the
train rows into those `{"prompt", "answer"}` rows; the launcher then runs the same
`flywheel sft` phase (`warmstart.sft_config`: `steps`, `batch_size`, `lr`, warm-up and
schedule, `label_smoothing`, `seed`) on `actor.path` before any service starts, so one
`flywheel run` does both. The result goes to `<trial dir>/model/sft` with
`warm_start.json`, and a later launch of the same trial reuses it.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from services.common.config import FlywheelConfig
from services.core.plugins import load_dotted
from services.launcher.agent_eval import importable_from_cwd
from services.launcher.warmstart import sft_config, sft_run_dir


def warm_start_rows(cfg: FlywheelConfig) -> list[dict[str, Any]]:
    """`rows_fn(train rows)`, checked: each row a prompt and a string answer."""
    from services.rollout.data.datasets import read_rows

    importable_from_cwd()
    fn = load_dotted(str(cfg.launcher.warm_start.rows_fn), "launcher.warm_start.rows_fn")
    rows = list(fn(read_rows(cfg.train_dataset.path)))  # type: ignore[arg-type]
    if not rows or not all("prompt" in r and isinstance(r.get("answer"), str) for r in rows):
        raise ValueError(
            f"launcher.warm_start.rows_fn={cfg.launcher.warm_start.rows_fn!r} must return "
            'a non-empty list of {"prompt": ..., "answer": str} rows'
        )
    return rows


def warm_start_given(cfg: FlywheelConfig, run_dir: Path, log: Any = print) -> Path:
    """Fine-tune the (resolved) `actor.path` on `rows_fn`'s rows; returns the model's
    directory, `<run_dir>/model/sft` (reused when its `warm_start.json` exists)."""
    from services.trainer.sft import run_sft

    ws = cfg.launcher.warm_start
    out_dir = run_dir / "model" / "sft"
    if (out_dir / "warm_start.json").exists():
        log(f"warm start: reusing {out_dir}")
        return out_dir
    rows = warm_start_rows(cfg)
    sft_dir = sft_run_dir(out_dir)
    shutil.rmtree(sft_dir, ignore_errors=True)  # a half-finished earlier attempt
    sft_dir.mkdir(parents=True)
    data_path = sft_dir / "data.jsonl"
    data_path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    log(f"warm start: {ws.steps} supervised steps on {len(rows)} rows of {ws.rows_fn}")

    def progress(record: dict[str, Any]) -> None:
        log(f"warm start step {record['step']}/{ws.steps} loss {record['loss']:.4f}")

    start = time.monotonic()
    summary = run_sft(
        sft_config(Path(str(cfg.actor.path)), data_path, ws, device=cfg.trainer.device),
        run_dir=sft_dir,
        label_smoothing=ws.label_smoothing,
        on_step=progress,
    )
    stats = {
        "warm_start_loss": float(summary["last_loss"]),
        "warm_start_seconds": time.monotonic() - start,
        "sft_run": str(sft_dir),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copytree(summary["model"], out_dir, dirs_exist_ok=True)
    (out_dir / "warm_start.json").write_text(json.dumps(stats))  # last: marks it done
    log(
        f"warm start done in {stats['warm_start_seconds']:.1f}s, loss {stats['warm_start_loss']:.4f}"
    )
    return out_dir
