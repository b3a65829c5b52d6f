"""Supervised warm start of the tiny demo model: a `flywheel sft` run on generated data.

Real RL recipes start from an instruction-tuned model that already answers in the asked
form and is usually right greedily but often wrong when sampled; RL then sharpens it. A
freshly initialised tiny model never produces `#### N`, so every reward would be 0 and
GRPO would have nothing to rank. The warm start is `services.trainer.sft.run_sft` (the
trainer's `TrainEngine`, the answer-token loss, `actor.optimizer`'s schedule) on the
train rows with their answers in the GSM8K form, with label smoothing so the policy ranks
the right sum first but stays unsure (high greedy, low sampled accuracy at T = 1).

`WarmStartConfig` becomes that run's config: `steps` -> `total_train_steps`,
`batch_size` -> `train_dataset.batch_size`, `lr` / `warmup_steps` / `cosine_decay` ->
`actor.optimizer` (AdamW without weight decay, gradient clipping at 1, a linear warm-up,
then constant or a cosine to 0.1 x the peak), `label_smoothing` -> the SFT loss's
smoothing, `seed` -> the data order. The run lives in `<out_dir>-run/` (its rows as
`data.jsonl`, `sft_metrics.jsonl`, `sft/summary.json`, `sft/hf`, TensorBoard events);
its export is copied to `out_dir`, and `warm_start.json`, written last, marks it done.

A vision run (the tiny Qwen2-VL on the counting images) warms up the same way: the rows keep
their images (paths made absolute) and their answers as they are (the digit the
`clevr_count` reward reads), and `flywheel sft` trains the VLM on the answer tokens with
each row's image through the model's processor (`services/trainer/sft_vision.py`).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.common.config import FlywheelConfig
from services.common.config.launcher import WarmStartConfig

MIN_LR_RATIO = 0.1
"""Where the cosine of `cosine_decay` ends, as a fraction of the peak rate."""


def vision_row(row: dict[str, Any], prompt_key: str, images_dir: Path) -> dict[str, Any]:
    """A vision row as the warm start trains on it: its question, its answer unchanged (the
    reward reads the number as the policy writes it) and its image paths made absolute."""
    from services.launcher.evaluation import question_of

    cell = row["images"] if "images" in row else row.get("image")
    cells = cell if isinstance(cell, list) else [cell]
    images = [str(images_dir / c) if isinstance(c, str) else c for c in cells]
    return {"prompt": question_of(row, prompt_key), "answer": str(row["answer"]), "images": images}


def target_text(row: dict[str, Any]) -> str:
    """The completion the model is taught: the answer in the GSM8K `#### N` form."""
    answer = str(row["answer"]).strip()
    return answer if "####" in answer else f"#### {answer}"


def sft_run_dir(out_dir: Path) -> Path:
    """Where the warm start's SFT run writes its rows, metrics, summary and export."""
    return out_dir.with_name(f"{out_dir.name}-run")


def sft_config(
    model_dir: Path, data_path: Path, cfg: WarmStartConfig, *, device: str = "cpu"
) -> FlywheelConfig:
    """The `flywheel sft` config of the warm start (float32, on `device`)."""
    return FlywheelConfig.model_validate(
        {
            "seed": cfg.seed,
            "total_train_steps": cfg.steps,
            "tokenizer_path": str(model_dir),
            "actor": {
                "path": str(model_dir),
                "dtype": "float32",
                "optimizer": {
                    "type": "adam",
                    "lr": cfg.lr,
                    "weight_decay": 0.0,
                    "warmup_steps": cfg.warmup_steps,
                    "lr_scheduler_type": "cosine" if cfg.cosine_decay else "constant",
                    "min_lr_ratio": MIN_LR_RATIO,
                    "gradient_clipping": 1.0,
                },
            },
            "trainer": {"device": device},
            "train_dataset": {
                "path": str(data_path),
                "type": "sft",
                "batch_size": cfg.batch_size,
                "prompt_key": "prompt",
                "answer_key": "answer",
            },
        }
    )


def warm_start(
    model_dir: Path,
    out_dir: Path,
    train_rows: Sequence[dict[str, Any]],
    cfg: WarmStartConfig,
    *,
    prompt_key: str = "prompt",
    device: str = "cpu",
    log: Any = print,
    images_dir: Path | None = None,
) -> dict[str, float]:
    """Fine-tune `model_dir` on (prompt -> answer) rows with `flywheel sft` and write the
    result to `out_dir` (a Hugging Face directory with `warm_start.json`). `images_dir`:
    the rows hold images (a vision run; their paths are relative to it), and `model_dir`
    is a vision-language model."""
    from services.trainer.sft import run_sft

    run_dir = sft_run_dir(out_dir)
    shutil.rmtree(run_dir, ignore_errors=True)  # a half-finished earlier attempt
    run_dir.mkdir(parents=True)
    data_path = run_dir / "data.jsonl"
    with data_path.open("w", encoding="utf-8") as fh:
        for row in train_rows:
            if images_dir is not None:
                out = vision_row(row, prompt_key, images_dir)
            else:
                out = {"prompt": row[prompt_key], "answer": target_text(row)}
            fh.write(json.dumps(out) + "\n")

    def progress(record: dict[str, Any]) -> None:
        step = int(record["step"])
        if step % 50 == 1 or step == cfg.steps:
            log(f"warm start step {step}/{cfg.steps} loss {record['loss']:.4f}")

    start = time.monotonic()
    summary = run_sft(
        sft_config(model_dir, data_path, cfg, device=device),
        run_dir=run_dir,
        label_smoothing=cfg.label_smoothing,
        on_step=progress,
    )
    seconds = time.monotonic() - start
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copytree(summary["model"], out_dir, dirs_exist_ok=True)
    stats = {"warm_start_loss": float(summary["last_loss"]), "warm_start_seconds": seconds}
    (out_dir / "warm_start.json").write_text(json.dumps({**stats, "sft_run": str(run_dir)}))
    return stats
