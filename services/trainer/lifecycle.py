"""Where a trainer run stands, from its files alone: not started, resumable, completed.

Importable without torch, so the launcher, `flywheel status`, a compose health check or a
Kubernetes probe can read it. Two small JSON records, each written atomically:

- `<checkpoint_dir>/completed.json`: written once, when the trainer reached
  `total_train_steps` (after its final checkpoint). It lives next to the checkpoints because
  it describes them: a run whose checkpoints are deleted starts over, and its completion goes
  with them. A trainer that starts and finds the run completed for its `total_train_steps`
  (this record, or a last checkpoint at or past that step) exits 0 at once.
- `<run_dir>/trainer_exit.json`: how the last trainer process ended (exit code, reason, step),
  rewritten at every exit. A trainer killed by a signal leaves the previous one (or none).

Exit codes of `python -m services.trainer`: 0 when the run is complete (just now, or already
at start) and after a requested stop (Stop RPC, SIGTERM) that ended with a checkpoint (or the
code given with `--stopped-exit-code`); 1 on a failure (the last checkpoint resumes it); 2 on a
bad configuration. Whether an exit 0 was a completion or a stop is what `completed.json` says.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from services.common.config import FlywheelConfig
from services.trainer.paths import RunPaths

STATE_FILE = "trainer_state.json"
COMPLETED_FILE = "completed.json"
EXIT_FILE = "trainer_exit.json"
STEP_DIR = re.compile(r"^step_(\d+)$")


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """Write `payload` to `path` so that a reader sees the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(payload, fh, indent=1, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint (its `trainer_state.json` written) with the highest step."""
    root = Path(root)
    if not root.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for child in root.iterdir():
        m = STEP_DIR.match(child.name)
        if m and (child / STATE_FILE).is_file():
            step = int(m.group(1))
            if best is None or step > best[0]:
                best = (step, child)
    return None if best is None else best[1]


def checkpoint_position(root: str | os.PathLike[str]) -> dict[str, Any] | None:
    """`{"step", "version", "path"}` of the latest complete checkpoint, or None."""
    path = latest_checkpoint(root)
    state = _read_json(path / STATE_FILE) if path is not None else None
    if path is None or state is None:
        return None
    step = int(state.get("step", 0))
    return {"step": step, "version": int(state.get("version", step)), "path": str(path)}


def read_completion(paths: RunPaths) -> dict[str, Any] | None:
    return _read_json(paths.checkpoint_dir / COMPLETED_FILE)


def write_completion(
    paths: RunPaths, *, step: int, version: int, total_train_steps: int, checkpoint: str | None
) -> Path:
    path = paths.checkpoint_dir / COMPLETED_FILE
    write_json_atomic(
        path,
        {
            "state": "completed",
            "step": step,
            "version": version,
            "total_train_steps": total_train_steps,
            "checkpoint": checkpoint,
            "wall_time": time.time(),
        },
    )
    return path


def completed_run(cfg: FlywheelConfig, paths: RunPaths | None = None) -> dict[str, Any] | None:
    """The completion of this run for its current `total_train_steps`, or None when there is
    training left (no total, fewer steps done, or `trainer.recover: disabled`). A last
    checkpoint at or past the total counts as completed even without the record (a crash
    between the two)."""
    total = cfg.total_train_steps
    if total is None or cfg.trainer.recover != "auto":
        return None  # `recover: disabled` never looks at what an earlier trainer left
    paths = paths or RunPaths.from_config(cfg)
    done = read_completion(paths)
    if done is not None and int(done.get("step", -1)) >= total:
        return done
    pos = checkpoint_position(paths.checkpoint_dir)
    if pos is not None and pos["step"] >= total:
        return {"state": "completed", "total_train_steps": total, "checkpoint": pos["path"]} | pos
    return None


def write_exit(paths: RunPaths, *, code: int, reason: str, step: int, version: int) -> None:
    write_json_atomic(
        paths.run_dir / EXIT_FILE,
        {
            "code": code,
            "reason": reason,
            "step": step,
            "version": version,
            "pid": os.getpid(),
            "wall_time": time.time(),
        },
    )


def run_state(
    paths: RunPaths, total_train_steps: int | None, *, trainer_running: bool
) -> dict[str, Any]:
    """What `flywheel status` says about the run as a whole:
    `completed` (the record), `running` (a trainer answers), `stopped` (the last trainer
    stopped on request: resumable), `failed` (it exited non-zero, or it is gone without an
    exit record: killed), or `not started` (no trace of a trainer)."""
    done = read_completion(paths)
    ckpt = checkpoint_position(paths.checkpoint_dir)
    info: dict[str, Any] = {
        "total_train_steps": total_train_steps,
        "last_checkpoint_step": ckpt["step"] if ckpt else None,
    }
    if done is not None and (
        total_train_steps is None or done.get("step", -1) >= total_train_steps
    ):
        return {"state": "completed", "step": done.get("step"), **info}
    if trainer_running:
        return {"state": "running", **info}
    last = _read_json(paths.run_dir / EXIT_FILE)
    if last is not None:
        state = "stopped" if int(last.get("code", 1)) == 0 else "failed"
        return {"state": state, "step": last.get("step"), "last_exit": last, **info}
    if ckpt is not None or paths.metrics_jsonl.exists():
        return {
            "state": "failed",
            "detail": "no trainer answers and none left an exit record (killed?)",
            **info,
        }
    return {"state": "not started", **info}
