"""Typed configuration of Flywheel: pydantic models per block, YAML loading, overrides.

`load_config(path, overrides)` reads a YAML file, applies dotted overrides
(`actor.eps_clip=0.3`, `+actor.new_key=1`), resolves `${a.b}` interpolation and
validates everything; any problem raises `ConfigError` naming the field path, the bad
value and the fix. Importable without torch.
"""

from .actor import (
    FSDPEngineConfig,
    FSDPWrapPolicy,
    MicroBatchSpec,
    NormConfig,
    OptimizerConfig,
    PPOActorConfig,
    PPOCriticConfig,
    RejectionSamplingConfig,
    TrainEngineConfig,
)
from .buffer import BufferConfig
from .dataset import DatasetConfig
from .generation import GenerationHyperparameters
from .reward import RewardConfig
from .rollout import RolloutConfig, SGLangServerConfig
from .root import ClusterSpecConfig, FlywheelConfig
from .scheduler import SchedulerConfig
from .services import EndpointConfig, ServicesConfig
from .trainer import TrainerConfig

__all__ = [
    "BufferConfig",
    "ClusterSpecConfig",
    "DatasetConfig",
    "EndpointConfig",
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
    "TrainEngineConfig",
    "TrainerConfig",
]
