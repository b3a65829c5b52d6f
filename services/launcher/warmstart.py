"""Supervised warm start of the tiny demo model on generated data, through `flywheel sft`.

Real RL recipes start from an instruction-tuned model that already answers in the asked
form and is sometimes right; RL then sharpens it. A freshly initialised tiny model never
produces `#### N`, so every reward would be 0 and GRPO would have nothing to rank. A short
answer-only supervised phase (loss on the answer tokens, not the prompt) gets sampled
accuracy to roughly a third, which leaves RL a clear job: lift it above 0.9.

The phase is a run of `services.trainer.sft.run_sft` (the trainer's `TrainEngine`, the
SFT loss, the `actor.optimizer` schedule) on the train rows with their answers in the
GSM8K form. `WarmStartConfig` becomes that run's config: `steps` -> `total_train_steps`,
`batch_size` -> `train_dataset.batch_size`, `lr`/`warmup_steps`/`cosine_decay` ->
`actor.optimizer` (AdamW, no weight decay, clipping at 1, a cosine to 0.1 x the peak),
`label_smoothing` -> the SFT loss's smoothing, `seed` -> the data order. The SFT run lives
in `<out_dir>-run/` (`sft_metrics.jsonl`, `sft/summary.json`, `sft/hf`, TensorBoard
events); the exported model is copied to `out_dir` with `warm_start.json`.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.common.config.launcher import WarmStartConfig


def target_text(row: dict[str, Any]) -> str:
    """The completion the model is taught: the answer in the GSM8K `#### N` form."""
    answer = str(row["answer"]).strip()
    return answer if "####" in answer else f"#### {answer}"


def sft_run_dir(out_dir: Path) -> Path:
    """Where the warm start's SFT run writes its metrics, summary and export."""
    return out_dir.with_name(f"{out_dir.name}-run")


def sft_config(model_dir: Path, data_path: Path, run_dir: Path, cfg: WarmStartConfig) -> Any:
    """The `flywheel sft` config that the warm start runs."""
    from services.common.config import FlywheelConfig
    from services.common.config.actor import OptimizerConfig

    sft = FlywheelConfig()
    sft.seed = cfg.seed
    sft.total_train_steps = cfg.steps
    sft.tokenizer_path = str(model_dir)
    sft.actor.path = str(model_dir)
    sft.actor.dtype = "float32"
    sft.actor.optimizer = OptimizerConfig(
        type="adam",
        lr=cfg.lr,
        weight_decay=0.0,
        warmup_steps=cfg.warmup_steps,
        lr_scheduler_type="cosine" if cfg.cosine_decay else "constant",
        min_lr_ratio=0.1,
        gradient_clipping=1.0,
    )
    sft.train_dataset.path = str(data_path)
    sft.train_dataset.type = "sft"
    sft.train_dataset.batch_size = cfg.batch_size
    sft.train_dataset.prompt_key = "prompt"
    sft.train_dataset.answer_key = "answer"
    sft.tracking.tensorboard.path = str(run_dir / "tensorboard")
    return sft


def warm_start(
    model_dir: Path,
    out_dir: Path,
    train_rows: Sequence[dict[str, Any]],
    cfg: WarmStartConfig,
    *,
    prompt_key: str = "prompt",
    log: Any = print,
) -> dict[str, float]:
    """Train `model_dir` on (prompt → answer) pairs with `flywheel sft`'s code and save the
    result to `out_dir` (HF)."""
    from services.trainer.sft import run_sft

    run_dir = sft_run_dir(out_dir)
    shutil.rmtree(run_dir, ignore_errors=True)  # a half-finished earlier attempt
    run_dir.mkdir(parents=True)
    data_path = run_dir / "data.jsonl"
    with data_path.open("w", encoding="utf-8") as fh:
        for row in train_rows:
            rec = {"prompt": row[prompt_key], "answer": target_text(row)}
            fh.write(json.dumps(rec) + "\n")
    start = time.monotonic()
    log(f"warm start: flywheel sft in {run_dir}")
    summary = run_sft(
        sft_config(model_dir, data_path, run_dir, cfg),
        run_dir=run_dir,
        label_smoothing=cfg.label_smoothing,
    )
    seconds = time.monotonic() - start
    with (run_dir / "sft_metrics.jsonl").open(encoding="utf-8") as fh:
        for line in fh:
            rec = json.loads(line)
            if rec["step"] % 50 == 1 or rec["step"] == summary["steps"]:
                log(f"warm start step {rec['step']}/{summary['steps']} loss {rec['loss']:.4f}")
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copytree(summary["model"], out_dir, dirs_exist_ok=True)
    stats = {"warm_start_loss": float(summary["last_loss"]), "warm_start_seconds": seconds}
    (out_dir / "warm_start.json").write_text(json.dumps({**stats, "sft_run": str(run_dir)}))
    return stats
