"""Every default that AReaL also has equals AReaL's, and every field is documented.

The tables below are written by hand from AReaL's `areal/api/cli_args.py`
(`NormConfig`, `MicroBatchSpec`, `GenerationHyperparameters`, `OptimizerConfig`,
`FSDPEngineConfig`, `TrainEngineConfig`, `PPOActorConfig`, `PPOCriticConfig`,
`RejectionSamplingConfig`, `InferenceEngineConfig`, `DatasetConfig`,
`BaseExperimentConfig`, `ClusterSpecConfig`). Where Flywheel deliberately differs, the
field is in DEVIATIONS with the reason, and the test checks both values.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from services.common.config import (
    ClusterSpecConfig,
    DatasetConfig,
    FlywheelConfig,
    FSDPEngineConfig,
    GenerationHyperparameters,
    MicroBatchSpec,
    NormConfig,
    OptimizerConfig,
    PPOActorConfig,
    PPOCriticConfig,
    RejectionSamplingConfig,
    RolloutConfig,
    TrainEngineConfig,
)

AREAL_DEFAULTS: dict[type[BaseModel], dict[str, Any]] = {
    NormConfig: {
        "mean_level": "batch",
        "mean_leave1out": False,
        "std_level": "batch",
        "std_unbiased": True,
        "eps": 1e-5,
        "group_size": 1,
    },
    MicroBatchSpec: {
        "n_mbs": 1,
        "granularity": 1,
        "max_tokens_per_mb": None,
        "n_mbs_divisor": 1,
        "packing_algorithm": "ffd",
    },
    GenerationHyperparameters: {
        "n_samples": 1,
        "max_new_tokens": 16384,
        "min_new_tokens": 0,
        "max_tokens": 32768,
        "greedy": False,
        "top_p": 1.0,
        "top_k": 100_000_000,
        "temperature": 1.0,
        "stop_token_ids": [],
        "ignore_eos": False,
        "skip_special_tokens": True,
        "stop": None,
        "frequency_penalty": 0.0,
        "seed": None,
        "drop_incomplete_group": False,
    },
    OptimizerConfig: {
        "type": "adam",
        "lr": 1e-3,
        "weight_decay": 0.01,
        "beta1": 0.9,
        "beta2": 0.999,
        "eps": 1e-8,
        "min_lr_ratio": 0.0,
        "lr_scheduler_type": "constant",
        "warmup_steps_proportion": 0.001,
        "warmup_steps": None,
        "offload": False,
        "initial_loss_scale": 2.0**32,
        "min_loss_scale": 1.0,
        "loss_scale_window": 5,
        "hysteresis": 2,
        "gradient_clipping": 1.0,
    },
    FSDPEngineConfig: {
        "wrap_policy": None,
        "offload_params": False,
        "memory_efficient_load": False,
    },
    TrainEngineConfig: {
        "path": "",
        "init_from_scratch": False,
        "is_critic": False,
        "temperature": 1.0,
        "logprobs_chunk_size": 1024,
        "pad_to_maximum": False,
        "disable_dropout": False,
        "gradient_checkpointing": False,
        "dtype": "bfloat16",
        "grad_reduce_dtype": "float32",
        "optimizer_dtype": "float32",
        "optimizer": None,
        "offload": False,
        "use_lora": False,
        "lora_rank": 32,
        "lora_alpha": 16,
        "target_modules": [],
        "peft_type": "lora",
    },
    PPOActorConfig: {
        "group_size": 1,
        "ppo_n_minibatches": 4,
        "eps_clip": 0.2,
        "eps_clip_higher": None,
        "c_clip": None,
        "temperature": 1.0,
        "m2_threshold": None,
        "reward_norm": None,
        "reward_scaling": 1.0,
        "reward_bias": 0.0,
        "reward_clip": 20.0,
        "overlong_reward_penalty": False,
        "overlong_tokens": None,
        "overlong_penalty_factor": None,
        "mask_no_eos_with_zero": False,
        "discount": 1.0,
        "gae_lambda": 1.0,
        "gae_lambda_kwargs": {},
        "gae_timestep_unit": "token",
        "adv_norm": None,
        "min_usable_group_size": None,
        "kl_estimator": "k1",
        "use_sapo_loss": False,
        "sapo_tau_pos": 1.0,
        "sapo_tau_neg": 1.05,
        "use_cispo_loss": False,
        "recompute_logprob": False,
        "use_decoupled_loss": False,
        "rejection_sampling": None,
        "importance_sampling_level": "token",
        "prox_logp_method": "recompute",
        "dynamic_sampling": False,
        "log_agent_stats": False,
        "log_agent_stats_keys": [],
        "max_new_tokens": 1024,
        # inherited engine fields keep AReaL's defaults too
        "dtype": "bfloat16",
        "gradient_checkpointing": False,
        "optimizer": None,
    },
    PPOCriticConfig: {
        "ppo_n_minibatches": 4,
        "eps_clip": 0.5,
        "mask_no_eos_with_zero": False,
    },
    RejectionSamplingConfig: {
        "level": "token",
        "action": "mask",
        "metric": "ratio",
        "agg": "mean",
        "upper": 5.0,
        "lower": None,
    },
    RolloutConfig: {
        "max_concurrent_rollouts": None,
        "queue_size": None,
        "consumer_batch_size": 1,
        "max_head_offpolicyness": 0,
        "enable_rollout_tracing": False,
        "deterministic_sampling": False,
        "check_trajectory_format": False,
        "tokenizer_path": "",
        "dump_to_file": False,
        "schedule_policy": "round_robin",
        "setup_timeout": 300.0,
        "request_timeout": 3600.0,
        "request_retries": 3,
        "pause_grace_period": 0.0,
    },
    DatasetConfig: {
        "batch_size": 1,
        "shuffle": True,
        "pin_memory": False,
        "num_workers": 0,
        "drop_last": True,
        "max_length": None,
    },
    ClusterSpecConfig: {"cluster_name": "local"},
}

# Root-level (BaseExperimentConfig) defaults.
AREAL_ROOT_DEFAULTS = {
    "seed": 1,
    "total_train_epochs": 1,
    "total_train_steps": None,
    "tokenizer_path": "",
    "valid_dataset": None,
}

# (model, field): (AReaL's default, Flywheel's default, why)
DEVIATIONS: dict[tuple[type[BaseModel], str], tuple[Any, Any, str]] = {
    (TrainEngineConfig, "attn_impl"): (
        "flash_attention_2",
        "sdpa",
        "flash-attn needs CUDA; sdpa runs on CPU too (the embedded default)",
    ),
    (PPOCriticConfig, "is_critic"): (
        False,
        True,
        "the critic block is always a value model",
    ),
    (ClusterSpecConfig, "fileroot"): ("/tmp/areal/", "/tmp/flywheel", "project name"),
    # areal/trainer/rl_trainer.py builds the reference engine only when
    # `actor.kl_ctl > 0 and ref is not None`; areal/trainer/ppo/actor.py
    # (PPOActor.compute_advantages) then takes ref_logp = zeros, so with k1 the "KL reward"
    # is -0.1 * (log pi_old - 0) = +0.1 * surprisal: a bonus, not a penalty. Every
    # examples/math/gsm8k_*.yaml of AReaL sets kl_ctl: 0.0.
    (PPOActorConfig, "kl_ctl"): (
        0.1,
        0.0,
        "AReaL's 0.1 without a reference model is a surprisal bonus; > 0 here needs `ref`",
    ),
}


def _cases() -> list[tuple[type[BaseModel], str, Any]]:
    return [(m, f, v) for m, table in AREAL_DEFAULTS.items() for f, v in table.items()]


@pytest.mark.parametrize(
    ("model", "field", "areal"), _cases(), ids=lambda x: getattr(x, "__name__", str(x))
)
def test_default_equals_areal(model: type[BaseModel], field: str, areal: Any) -> None:
    value = getattr(model(), field)
    assert value == areal, f"{model.__name__}.{field}: Flywheel {value!r} != AReaL {areal!r}"
    # 1 == 1.0 == True in Python; the kind must match too (a bool is not a count).
    if isinstance(areal, bool) or areal is None:
        assert value is areal
    elif isinstance(areal, float):
        assert isinstance(value, float) and not isinstance(value, bool)


def test_root_defaults_equal_areal() -> None:
    root = FlywheelConfig()
    for field, areal in AREAL_ROOT_DEFAULTS.items():
        assert getattr(root, field) == areal, field


@pytest.mark.parametrize(("key", "values"), list(DEVIATIONS.items()), ids=str)
def test_documented_deviations(key: tuple[type[BaseModel], str], values: tuple) -> None:
    model, field = key
    areal, flywheel, why = values
    assert why
    assert areal != flywheel
    assert getattr(model(), field) == flywheel


def test_actor_inherits_engine_fields() -> None:
    # AReaL's PPOActorConfig is a TrainEngineConfig: an AReaL actor block carries over.
    for name in TrainEngineConfig.model_fields:
        assert name in PPOActorConfig.model_fields


def _models(root: type[BaseModel]) -> set[type[BaseModel]]:
    import typing

    seen: set[type[BaseModel]] = set()
    stack = [root]
    while stack:
        model = stack.pop()
        if model in seen:
            continue
        seen.add(model)
        for field in model.model_fields.values():
            for arg in [field.annotation, *typing.get_args(field.annotation)]:
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    stack.append(arg)
    return seen


def test_every_field_has_a_description() -> None:
    models = _models(FlywheelConfig) | {PPOCriticConfig, TrainEngineConfig}
    missing = [
        f"{m.__name__}.{name}"
        for m in models
        for name, field in m.model_fields.items()
        if not (field.description and field.description.strip())
    ]
    assert missing == []
    assert len(models) >= 20  # the walk really reached the nested blocks


def test_every_block_forbids_unknown_keys() -> None:
    for model in _models(FlywheelConfig):
        assert model.model_config.get("extra") == "forbid", model.__name__
