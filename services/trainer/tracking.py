"""Experiment tracking of the trainer's step records, under AReaL's metric names.

Rank 0 hands every step record (the dict written to `metrics.jsonl`) to `Tracker.log`,
which renames the statistics as AReaL's `stats_tracker` exports them and writes them to

- TensorBoard event files, always (`tracking.tensorboard.path`, default
  `<run_dir>/tensorboard`), with `torch.utils.tensorboard`;
- Weights & Biases when `tracking.wandb.mode` is not `disabled` (`offline` writes a run
  directory that `wandb sync` uploads later);
- MLflow when `tracking.mlflow.mode` is not `disabled` (`offline`: a file store under
  `<run_dir>/mlruns`).

The libraries come with the `tracking` extra. Without `tensorboard` installed the trainer
logs one warning and writes no event files (it never fails a run over tracking); a W&B or
MLflow run that is asked for but cannot be imported is an error at start.

AReaL's names (`areal/trainer/ppo/actor.py`, `areal/workflow/rlvr.py`): the statistics of
the loss are under `ppo_actor/update/` (`importance_weight/avg`, `approx_kl/max`,
`clip_ratio/avg`, `grad_norm`, `lr`, ...), those of the advantage pass under `ppo_actor/`
with AReaL's `/avg` suffix (`task_reward/avg`, `no_eos_ratios/avg`, `seq_len/avg`,
`final_reward/avg`), the episode reward of the rollout is `rollout/reward`, phase times are
`timeperf/<phase>`. Statistics AReaL does not have keep Flywheel's name under `flywheel/`.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Statistics of the loss (`<name>/avg|min|max`): AReaL's `ppo_actor/update/` scope.
_UPDATE_STATS = (
    "importance_weight",
    "approx_kl",
    "clip_ratio",
    "dual_clip_ratio",
    "actor_loss",
    "entropy",
    "behave_imp_weight",
    "behave_approx_kl",
    "behave_filtered_ratio",
)

# Scalars of the loss that AReaL exports under the same scope, without a suffix.
_UPDATE_SCALARS = ("n_total_tokens", "n_masked_tokens", "masked_token_ratio")

# Per-sequence / per-token means of the advantage pass, by Flywheel's name: AReaL's name.
_ACTOR_MEANS = {
    "task_reward": "task_reward",
    "no_eos_ratio": "no_eos_ratios",
    "advantages": "advantages",
    "kl_rewards": "kl_rewards",
    "shaped_reward": "final_reward",
    "prompt_len": "prompt_len",
    "seq_len": "seq_len",
    "response_len": "response_len",
    "returns": "returns",
}

# Counts (AReaL exports its denominators as sums, without a suffix).
_ACTOR_COUNTS = ("n_seqs", "n_valid_tokens", "correct_n_seqs", "incorrect_n_seqs")

# Record fields without an AReaL name, exported under `flywheel/`.
_FLYWHEEL_FIELDS = (
    "version",
    "staleness_max",
    "staleness_avg",
    "samples",
    "tokens",
    "tokens_per_second",
    "skipped_updates",
    "prox_forwards",
    "weight_broadcast_seconds",
    "replicas_updated",
)


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float) and math.isfinite(float(value)):
        return float(value)
    return None


def areal_metrics(record: Mapping[str, Any]) -> dict[str, float]:
    """The numeric statistics of one step record under AReaL's names."""
    out: dict[str, float] = {}

    def put(name: str, value: Any) -> None:
        number = _number(value)
        if number is not None:
            out[name] = number

    stats: Mapping[str, Any] = record.get("stats") or {}
    used: set[str] = set()
    for key, value in stats.items():
        base, _, reduction = key.partition("/")
        per_token = base in _UPDATE_STATS and reduction in ("avg", "min", "max")
        if per_token or (not reduction and key in _UPDATE_SCALARS):
            put(f"ppo_actor/update/{key}", value)
        elif not reduction and key in _ACTOR_MEANS:
            put(f"ppo_actor/{_ACTOR_MEANS[key]}/avg", value)
        elif not reduction and key in _ACTOR_COUNTS:
            put(f"ppo_actor/{key}", value)
        else:
            continue
        used.add(key)
    for key, value in stats.items():
        if key not in used and key != "actor_loss":  # its /avg|min|max are exported
            put(f"flywheel/{key}", value)
    if "ppo_actor/no_eos_ratios/avg" not in out:
        put("ppo_actor/no_eos_ratios/avg", record.get("no_eos_ratio"))
    put("rollout/reward", record.get("task_reward"))
    put("ppo_actor/update/grad_norm", record.get("grad_norm"))
    put("ppo_actor/update/lr", record.get("lr"))
    put("ppo_actor/update/loss", record.get("loss"))
    put("ppo_critic/update/loss", record.get("critic_loss"))
    put("timeperf/step", record.get("step_seconds"))
    for phase, seconds in (record.get("phase_seconds") or {}).items():
        put(f"timeperf/{phase}", seconds)
    for key in _FLYWHEEL_FIELDS:
        put(f"flywheel/{key}", record.get(key))
    return out


def _flat_params(tree: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    flat: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flat_params(value, name + "."))
        else:
            flat[name] = str(value)[:500]  # MLflow caps parameter values
    return flat


class Tracker:
    """Writes step records to TensorBoard (always), W&B and MLflow (when enabled)."""

    def __init__(self, cfg: Any, run_dir: str | os.PathLike[str]) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        track = cfg.tracking
        self._tb: Any = None
        self._wandb: Any = None
        self._mlflow: Any = None
        self.tensorboard_dir = Path(track.tensorboard.path or self.run_dir / "tensorboard")
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            log.warning(
                "tensorboard is not installed: no event files (pip install 'flywheel[tracking]')"
            )
        else:
            self._tb = SummaryWriter(log_dir=str(self.tensorboard_dir))
        if track.wandb.mode != "disabled":
            self._wandb = self._start_wandb(track.wandb)
        if track.mlflow.mode != "disabled":
            self._mlflow = self._start_mlflow(track.mlflow)

    def _start_wandb(self, w: Any) -> Any:
        import wandb

        cfg = self.cfg
        directory = Path(w.dir or self.run_dir)
        directory.mkdir(parents=True, exist_ok=True)
        return wandb.init(
            mode=w.mode,
            project=w.project or cfg.experiment_name,
            entity=w.entity,
            name=w.name or cfg.trial_name,
            job_type=w.job_type,
            group=w.group or f"{cfg.experiment_name}_{cfg.trial_name}",
            notes=w.notes,
            tags=w.tags,
            dir=str(directory),
            config=cfg.model_dump(mode="json"),
            id=f"{cfg.experiment_name}_{cfg.trial_name}",
            resume="allow",
            reinit=True,
        )

    def _start_mlflow(self, m: Any) -> Any:
        import mlflow

        cfg = self.cfg
        uri = m.tracking_uri or (self.run_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            # MLflow 3 keeps its file store behind an opt-in; a local store needs no server.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(m.experiment or cfg.experiment_name)
        run = mlflow.start_run(run_name=m.run_name or cfg.trial_name)
        params = _flat_params(cfg.model_dump(mode="json"))
        items = sorted(params.items())
        for start in range(0, len(items), 100):  # MLflow's batch limit
            mlflow.log_params(dict(items[start : start + 100]))
        return run

    def log(self, record: Mapping[str, Any]) -> dict[str, float]:
        """Write one step record; returns what was written (name: value)."""
        metrics = areal_metrics(record)
        self.log_named(metrics, int(record.get("step", 0)))
        return metrics

    def log_named(self, metrics: Mapping[str, float], step: int) -> None:
        """Write metrics that already carry their names (`sft/loss`, ...) at `step`."""
        metrics = {k: float(v) for k, v in metrics.items() if _number(v) is not None}
        if self._tb is not None:
            for name, value in metrics.items():
                self._tb.add_scalar(name, value, global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if self._mlflow is not None:
            import mlflow

            mlflow.log_metrics(metrics, step=step)

    def close(self) -> None:
        """Flush and close every writer (idempotent)."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._mlflow is not None:
            import mlflow

            mlflow.end_run()
            self._mlflow = None
