"""The root model `FlywheelConfig`: one file describes a whole experiment."""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from ._base import FlywheelModel, RuleViolation
from .actor import PPOActorConfig, PPOCriticConfig, TeacherConfig
from .buffer import BufferConfig
from .dataset import DatasetConfig, ValidDatasetConfig
from .generation import GenerationHyperparameters
from .launcher import LauncherConfig
from .reward import RewardConfig
from .rollout import RolloutConfig
from .scheduler import SchedulerConfig
from .services import ServicesConfig
from .tracking import TrackingConfig
from .train_engine import TrainEngineConfig
from .trainer import TrainerConfig

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")

SERVICE_BLOCKS: dict[str, frozenset[str]] = {
    "reward": frozenset({"reward", "services", "cluster"}),
    "buffer": frozenset({"buffer", "rollout", "services", "cluster"}),
    "rollout": frozenset(
        {"rollout", "actor", "gconfig", "reward", "train_dataset", "trainer", "services", "cluster"}
    ),
}
"""The blocks each service reads (the rollout reads `actor.path` and the trainer's weight
directory). Loaded for one of these services (`load_config(..., service=...)`), a config is
validated only as far as that service uses it: rules that concern the trainer alone (a KL
penalty needs `ref`, the trainer's temperature, NCCL on GPUs) are not applied, and an
invalid block the service does not read is reported, not fatal. The trainer, the launcher
and `flywheel run` check everything."""
_WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]", ""})


def _replicas_have_own_addresses(endpoint: Any) -> bool:
    """Rollout replicas on one port (`port_stride: 0`) that bind a wildcard address: each
    runs in its own network namespace (a pod, a container; the Helm chart and the
    Kubernetes launcher pass `services.rollout.host=0.0.0.0` to the replica they start), so
    they cannot take each other's port. On one named or loopback host they would."""
    return endpoint.port_stride == 0 and endpoint.replica_host(1) in _WILDCARD_HOSTS


class ClusterSpecConfig(FlywheelModel):
    """Storage shared by every service."""

    fileroot: str = "/tmp/flywheel"
    """Root of logs, checkpoints, weights and metrics; must be visible to every service
    (a shared volume on Kubernetes)."""

    cluster_name: str = "local"
    """Name of the cluster, recorded in logs."""


class FlywheelConfig(FlywheelModel):
    """A whole Flywheel experiment."""

    experiment_name: str = "flywheel"
    """Experiment name; part of every path under `cluster.fileroot`."""

    trial_name: str = "trial0"
    """Trial name within the experiment; part of every path."""

    seed: int = 1
    """Seed of data order, sampling and initialisation."""

    total_train_epochs: int = Field(default=1, ge=1)
    """Passes over the training set."""

    total_train_steps: int | None = Field(default=None, ge=1)
    """Stop after this many trainer steps (null: run the epochs)."""

    tokenizer_path: str = ""
    """Tokenizer; empty uses the actor's `path`."""

    cluster: ClusterSpecConfig = Field(default_factory=ClusterSpecConfig)
    """Shared storage."""

    actor: PPOActorConfig = Field(default_factory=PPOActorConfig)
    """The policy and its loss."""

    critic: PPOCriticConfig | None = None
    """Value model (PPO with GAE); null for critic-free methods."""

    ref: TrainEngineConfig | None = None
    """Reference model of the KL penalty; needed when `actor.kl_ctl > 0`."""

    teacher: TeacherConfig | None = None
    """Teacher model of on-policy distillation (AReaL's `teacher`); null: no teacher term."""

    gconfig: GenerationHyperparameters = Field(default_factory=GenerationHyperparameters)
    """Sampling settings of the rollout."""

    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Rollout service."""

    buffer: BufferConfig = Field(default_factory=BufferConfig)
    """Buffer service."""

    reward: RewardConfig = Field(default_factory=RewardConfig)
    """Reward service."""

    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """Trainer service."""

    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    """Experiment tracking (TensorBoard always; W&B, MLflow when enabled); AReaL's
    `stats_logger`."""

    services: ServicesConfig = Field(default_factory=ServicesConfig)
    """Addresses, auth and message limits."""

    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    """Where services run."""

    launcher: LauncherConfig = Field(default_factory=LauncherConfig)
    """What the local launcher prepares (tiny model, warm start) and how it evaluates."""

    train_dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    """Training prompts."""

    valid_dataset: ValidDatasetConfig | None = None
    """Evaluation prompts; null disables evaluation."""

    @field_validator("experiment_name", "trial_name")
    @classmethod
    def _safe_name(cls, value: str, info: object) -> str:
        # Names become directory names, Redis key prefixes and Kubernetes labels.
        if not _NAME.match(value) or len(value) > 63:
            raise RuleViolation(
                getattr(info, "field_name", "name"),
                value,
                "use 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit",
            )
        return value

    @model_validator(mode="after")
    def _cross_block_rules(self, info: ValidationInfo) -> FlywheelConfig:
        service = (info.context or {}).get("service")
        if service in ("reward", "buffer"):
            self._check_ports()  # the only rule across the blocks they read
            return self
        if service != "rollout":  # the rollout samples; the rest is the trainer's
            self._check_trainer_rules()
        if self.train_dataset.path is None and self.train_dataset.builtin is None:
            raise RuleViolation(
                "train_dataset.path",
                None,
                "no training data: set train_dataset.path to a JSONL/parquet file or "
                "train_dataset.builtin: arithmetic",
            )
        self._check_ports()
        return self

    def _check_trainer_rules(self) -> None:
        """Rules between the blocks the trainer reads (actor, ref, teacher, gconfig, trainer)."""
        self._check_reference_model()
        self._check_teacher()
        if self.actor.temperature != self.gconfig.temperature:
            raise RuleViolation(
                "actor.temperature",
                self.actor.temperature,
                f"differs from gconfig.temperature={self.gconfig.temperature}: the trainer "
                "would score tokens under another distribution than the one that sampled "
                "them; set both to the same value (actor.temperature: ${gconfig.temperature})",
            )
        if self.trainer.weight_fanout == "two_level" and self.rollout.engine != "torch":
            raise RuleViolation(
                "trainer.weight_fanout",
                "two_level",
                f"relays re-broadcast in the torch engine, and rollout.engine is "
                f"{self.rollout.engine!r}; use weight_fanout: flat with SGLang",
            )
        if self.trainer.backend == "nccl" and self.trainer.device == "cpu":
            raise RuleViolation(
                "trainer.backend",
                "nccl",
                "NCCL needs GPUs but trainer.device is 'cpu'; use backend: gloo or device: cuda",
            )

    def _check_reference_model(self) -> None:
        # AReaL computes the KL term against whatever "ref" logprobs exist; without a
        # reference model it silently becomes a surprisal bonus on the policy itself.
        if self.actor.kl_ctl <= 0:
            return
        if self.ref is None:
            raise RuleViolation(
                "actor.kl_ctl",
                self.actor.kl_ctl,
                "a KL penalty needs a reference model, and `ref` is not set; add "
                "`ref: {path: <same checkpoint as actor.path>}` or set actor.kl_ctl: 0",
            )
        if not self.ref.path and self.actor.path and not self.ref.init_from_scratch:
            raise RuleViolation(
                "ref.path",
                self.ref.path,
                f"actor.kl_ctl={self.actor.kl_ctl} needs the reference checkpoint; set "
                "ref.path (usually ${actor.path}) or set actor.kl_ctl: 0",
            )

    def _check_teacher(self) -> None:
        # As for `ref`: an empty path would silently score with the embedded tiny model.
        t = self.teacher
        if t is not None and not t.path and self.actor.path and not t.init_from_scratch:
            raise RuleViolation(
                "teacher.path",
                t.path,
                "on-policy distillation needs the teacher's checkpoint; set teacher.path "
                "(a model with the actor's tokenizer) or remove the teacher block",
            )

    def _check_ports(self) -> None:
        taken: dict[tuple[str, int], str] = {}
        for name in ("rollout", "reward", "buffer", "trainer"):
            endpoint = getattr(self.services, name)
            count = self.rollout.n_replicas if name == "rollout" else 1
            if name == "rollout" and _replicas_have_own_addresses(endpoint):
                count = 1  # replica i binds the same port in its own pod or container
            for kind in ("port", "metrics_port"):
                if getattr(endpoint, kind) == 0:
                    continue
                for i in range(count):
                    if name == "rollout":
                        host, port = endpoint.replica_host(i), endpoint.replica_port(i, kind)
                    else:
                        host, port = endpoint.host, getattr(endpoint, kind)
                    path = f"services.{name}.{kind}"
                    if (host, port) in taken:
                        raise RuleViolation(
                            path,
                            getattr(endpoint, kind),
                            f"port {port} on {host} is also {taken[(host, port)]}; give every "
                            "service its own ports (rollout replica i uses port + "
                            "port_stride * i)",
                        )
                    taken[(host, port)] = path
