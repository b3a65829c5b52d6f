"""The trainer's step lines in `metrics.jsonl`: what one line holds, and how the lines are
put right after a crash.

A step's line is written once its weights are published, which with
`trainer.overlap_weight_publication` happens while the next step trains, but the step's
checkpoint is written before that. So a copy of the line goes to `PENDING_RECORDS_DIR`
before the checkpoint: a trainer killed in between leaves it there, and the resumed trainer
(`cut_metrics`) ends up with exactly one line for every step its checkpoint holds, and moves
the lines of steps trained after it (their weights are gone) to `LOST_METRICS_FILE`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from services.trainer.ppo import StepResult

log = logging.getLogger(__name__)

LOST_METRICS_FILE = "metrics.lost.jsonl"
PENDING_RECORDS_DIR = "metrics.pending"
"""Next to `metrics.jsonl`: one JSON file per trained step whose line is not written yet (it
waits for the step's publication). Written before the step's checkpoint, so a trainer that
dies with the line unwritten leaves it here, and the resumed one restores the lines of the
steps its checkpoint holds (`cut_metrics`)."""
INTERRUPTED_PUBLICATION = "interrupted: the trainer stopped before the replicas confirmed it"


def pending_record_path(metrics_jsonl: Path, step: int) -> Path:
    """Where step `step`'s line waits for its publication."""
    return metrics_jsonl.with_name(PENDING_RECORDS_DIR) / f"step-{step:08d}.json"


def step_record(
    r: StepResult,
    phases: dict[str, float],
    ids: list[str],
    step_seconds: float,
    *,
    step: int,
    version: int,
    wall_time: float | None = None,
) -> dict[str, Any]:
    """The step's line of `metrics.jsonl` without the publication's fields."""
    train_s = phases.get("train", 0.0)
    record: dict[str, Any] = {
        "step": step,
        "version": version,
        "task_reward": r.stats.get("task_reward"),
        "staleness_max": r.stats.get("staleness_max", 0.0),
        "staleness_avg": r.stats.get("staleness_avg", 0.0),
        "importance_weight": r.stats.get("importance_weight/avg"),
        "behave_imp_weight": r.stats.get("behave_imp_weight/avg"),
        "no_eos_ratio": r.stats.get("no_eos_ratio"),
        "loss": r.loss,
        "losses": r.minibatch_losses,
        "grad_norm": r.grad_norm,
        "lr": r.lr,
        "samples": r.n_seqs,
        "tokens": r.n_tokens,
        "tokens_per_second": r.n_tokens / train_s if train_s > 0 else 0.0,
        "skipped_updates": r.skipped_updates,
        "prox_forwards": r.prox_forwards,
        "step_seconds": step_seconds,
        "phase_seconds": phases,
        "group_ids": ids,
        "staleness_per_seq": r.staleness_per_seq,
        "stats": r.stats,
        "wall_time": time.time() if wall_time is None else wall_time,
    }
    if r.critic_loss is not None:
        record["critic_loss"] = r.critic_loss
    return record


def _take_pending_records(
    metrics_jsonl: Path, step: int, seen: set[int], keep: list[str], lost: list[str]
) -> None:
    """Move the dead trainer's unwritten lines into `keep` (steps up to `step` not yet
    in `metrics.jsonl`) or `lost` (steps after it), and clear the directory."""
    folder = metrics_jsonl.with_name(PENDING_RECORDS_DIR)
    restored = False
    for f in sorted(folder.glob("step-*.json")) if folder.is_dir() else []:
        try:
            record = json.loads(f.read_text())
        except ValueError:  # cut short by the crash: that step's checkpoint is not there
            record = None
        new = (
            isinstance(record, dict)
            and isinstance(record.get("step"), int)
            and record["step"] not in seen
        )
        if new:
            assert isinstance(record, dict)
            record["publication"] = INTERRUPTED_PUBLICATION
            if record["step"] <= step:
                keep.append(json.dumps(record))
                restored = True
            else:
                lost.append(json.dumps(record))
        f.unlink(missing_ok=True)
    if restored:
        keep.sort(key=lambda x: json.loads(x).get("step", 0))


def cut_metrics(path: Path, step: int) -> None:
    """`metrics.jsonl` at `path` keeps the steps up to the resumed one, each once; records
    of steps after it (trained by weights that are gone) move to `metrics.lost.jsonl`.
    A step the checkpoint holds whose line the dead trainer never wrote (its publication
    was in flight) gets it from `PENDING_RECORDS_DIR`, marked as interrupted."""
    keep: list[str] = []
    lost: list[str] = []
    lines = [x for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []
    seen: set[int] = set()
    for line in lines:
        try:
            record_step = json.loads(line).get("step")
        except ValueError:  # a line cut short by the crash
            continue
        if isinstance(record_step, int):
            seen.add(record_step)
        (lost if isinstance(record_step, int) and record_step > step else keep).append(line)
    _take_pending_records(path, step, seen, keep, lost)
    if keep == lines and not lost:
        return
    lost_groups = sum(len(json.loads(x).get("group_ids", [])) for x in lost)
    with open(path.with_name(LOST_METRICS_FILE), "a") as fh:
        fh.writelines(x + "\n" for x in lost)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(x + "\n" for x in keep))
    os.replace(tmp, path)
    if lost:
        log.warning(
            "steps after the checkpoint were lost with the old trainer; they are trained "
            "again (their groups stay acknowledged)",
            extra={
                "resumed_at_step": step,
                "lost_steps": [json.loads(x).get("step") for x in lost],
                "lost_groups": lost_groups,
                "moved_to": str(path.with_name(LOST_METRICS_FILE)),
            },
        )
