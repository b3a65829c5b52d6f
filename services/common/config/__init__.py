"""Typed configuration of Flywheel: pydantic models per block, YAML loading, overrides.

`load_config(path, overrides)` reads a YAML file, applies dotted overrides
(`actor.eps_clip=0.3`, `+actor.new_key=1`), resolves `${a.b}` interpolation and
validates everything; any problem raises `ConfigError` naming the field path, the bad
value and the fix. Importable without torch.

A bare `FlywheelConfig()` is valid: `actor.kl_ctl` defaults to 0 (AReaL's 0.1 without a
reference model is a surprisal bonus, not a KL penalty). A KL penalty (`kl_ctl > 0`) needs
a `ref` with a path, and is rejected at load without one.
"""

from ._base import FlywheelModel, RuleViolation, masked_url
from .actor import PPOActorConfig, PPOCriticConfig, TeacherConfig
from .buffer import BufferConfig
from .dataset import DatasetConfig
from .errors import ConfigError, ConfigIssue
from .generation import GenerationHyperparameters
from .interpolation import resolve_interpolations
from .launcher import (
    EvalConfig,
    LauncherConfig,
    TinyModelConfig,
    TinyVLMConfig,
    WarmStartConfig,
)
from .loader import load_config, load_raw, to_yaml, validate
from .normalization import NormConfig
from .optimizer import OptimizerConfig
from .overrides import apply_override, parse_value
from .rejection_sampling import RejectionSamplingConfig
from .reward import RewardConfig
from .rollout import RolloutConfig, SGLangServerConfig
from .root import ClusterSpecConfig, FlywheelConfig
from .scheduler import SchedulerConfig
from .services import EndpointConfig, RolloutEndpointConfig, ServicesConfig
from .train_engine import FSDPEngineConfig, FSDPWrapPolicy, MicroBatchSpec, TrainEngineConfig
from .trainer import TrainerConfig

__all__ = [
    "ConfigError",
    "ConfigIssue",
    "FlywheelModel",
    "RuleViolation",
    "apply_override",
    "load_config",
    "load_raw",
    "masked_url",
    "parse_value",
    "resolve_interpolations",
    "to_yaml",
    "validate",
    "BufferConfig",
    "ClusterSpecConfig",
    "DatasetConfig",
    "EndpointConfig",
    "EvalConfig",
    "LauncherConfig",
    "RolloutEndpointConfig",
    "TinyModelConfig",
    "TinyVLMConfig",
    "WarmStartConfig",
    "FSDPEngineConfig",
    "FSDPWrapPolicy",
    "FlywheelConfig",
    "GenerationHyperparameters",
    "MicroBatchSpec",
    "NormConfig",
    "OptimizerConfig",
    "PPOActorConfig",
    "PPOCriticConfig",
    "RejectionSamplingConfig",
    "RewardConfig",
    "RolloutConfig",
    "SGLangServerConfig",
    "SchedulerConfig",
    "ServicesConfig",
    "TeacherConfig",
    "TrainEngineConfig",
    "TrainerConfig",
]
