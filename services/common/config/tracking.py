"""Tracking block: where the trainer's statistics go (AReaL's `stats_logger`).

TensorBoard event files are always written (the directory defaults to
`<cluster.fileroot>/<experiment>/<trial>/tensorboard`); Weights & Biases and MLflow
are written when their `mode` is not `disabled`. The libraries come with the `tracking`
extra (`pip install 'flywheel[tracking]'`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ._base import FlywheelModel, RuleViolation


class TensorBoardTrackingConfig(FlywheelModel):
    """TensorBoard event files (AReaL's `stats_logger.tensorboard`)."""

    path: str | None = None
    """Directory of the event files; null means
    `<cluster.fileroot>/<experiment>/<trial>/tensorboard` (point `tensorboard --logdir`
    at it or at a parent)."""


class WandBTrackingConfig(FlywheelModel):
    """Weights & Biases run (AReaL's `stats_logger.wandb`). The API key and base URL are
    read from `WANDB_API_KEY` / `WANDB_BASE_URL`, never from the config file."""

    mode: Literal["disabled", "offline", "online", "shared"] = "disabled"
    """`offline` writes a run directory for `wandb sync`; `online` streams; `disabled`
    writes nothing."""

    project: str | None = None
    """W&B project; null uses `experiment_name`."""

    entity: str | None = None
    """W&B entity (team or user); null uses the account's default."""

    name: str | None = None
    """Run name; null uses `trial_name`."""

    job_type: str | None = None
    """W&B job type."""

    group: str | None = None
    """W&B run group; null uses `<experiment_name>_<trial_name>`."""

    notes: str | None = None
    """Free-text notes of the run."""

    tags: list[str] | None = None
    """Tags of the run."""

    dir: str | None = None
    """Directory of W&B's local files; null means the trial directory under
    `cluster.fileroot`."""


class MLflowTrackingConfig(FlywheelModel):
    """MLflow run (no equivalent in AReaL)."""

    mode: Literal["disabled", "offline", "online"] = "disabled"
    """`offline` logs to a local file store (`tracking_uri` or `<trial dir>/mlruns`);
    `online` logs to `tracking_uri` (an MLflow server); `disabled` writes nothing."""

    tracking_uri: str | None = None
    """MLflow tracking URI; null means `file:<trial dir>/mlruns`."""

    experiment: str | None = None
    """MLflow experiment; null uses `experiment_name`."""

    run_name: str | None = None
    """MLflow run name; null uses `trial_name`."""

    @model_validator(mode="after")
    def _online_needs_a_server(self) -> MLflowTrackingConfig:
        if self.mode == "online" and not self.tracking_uri:
            raise RuleViolation(
                "tracking_uri",
                self.tracking_uri,
                "mode online logs to an MLflow server: set tracking_uri "
                "(http://host:5000), or use mode: offline for a local file store",
            )
        return self


class TrackingConfig(FlywheelModel):
    """Experiment tracking of the trainer's statistics, under AReaL's metric names
    (`ppo_actor/update/importance_weight/avg`, `rollout/reward`, ...)."""

    tensorboard: TensorBoardTrackingConfig = Field(default_factory=TensorBoardTrackingConfig)
    """TensorBoard event files (always written)."""

    wandb: WandBTrackingConfig = Field(default_factory=WandBTrackingConfig)
    """Weights & Biases."""

    mlflow: MLflowTrackingConfig = Field(default_factory=MLflowTrackingConfig)
    """MLflow."""
