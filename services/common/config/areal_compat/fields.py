"""AReaL's config field names, per block: which keys exist in AReaL, not what they do here.

The names are those of AReaL's config classes in `areal/api/cli_args.py` (AReaL 2.0, commit
cbff54d). They decide whether a file is an AReaL config and which of its keys are reported
as ignored.
"""

from __future__ import annotations

from typing import Any

_TRAIN_ENGINE = frozenset(
    [
        "experiment_name",
        "trial_name",
        "path",
        "attn_impl",
        "use_kernels",
        "init_from_scratch",
        "is_critic",
        "temperature",
        "logprobs_chunk_size",
        "mb_spec",
        "pad_to_maximum",
        "disable_dropout",
        "gradient_checkpointing",
        "dtype",
        "grad_reduce_dtype",
        "optimizer_dtype",
        "optimizer",
        "weight_update_mode",
        "enable_delta_weight_update",
        "weight_update_delta_method",
        "weight_update_anchor_interval",
        "fsdp",
        "archon",
        "megatron",
        "offload",
        "use_lora",
        "lora_rank",
        "lora_alpha",
        "target_modules",
        "peft_type",
        "enable_tree_training",
        "scheduling_spec",
        "backend",
        "_version",
        "admin_api_key",
        "log_level",
        "request_timeout",
        "setup_timeout",
        "workers_ready_timeout",
        "scheduling_strategy",
    ]
)
_PPO_ACTOR = _TRAIN_ENGINE | frozenset(
    [
        "ppo_n_minibatches",
        "eps_clip",
        "eps_clip_higher",
        "c_clip",
        "m2_threshold",
        "reward_norm",
        "reward_scaling",
        "reward_bias",
        "reward_clip",
        "overlong_reward_penalty",
        "overlong_tokens",
        "overlong_penalty_factor",
        "mask_no_eos_with_zero",
        "discount",
        "gae_lambda",
        "gae_lambda_kwargs",
        "gae_timestep_unit",
        "adv_norm",
        "kl_ctl",
        "kl_estimator",
        "use_sapo_loss",
        "sapo_tau_pos",
        "sapo_tau_neg",
        "use_cispo_loss",
        "recompute_logprob",
        "use_decoupled_loss",
        "rejection_sampling",
        "importance_sampling_level",
        "prox_logp_method",
        "log_agent_stats",
        "log_agent_stats_keys",
        "max_new_tokens",
    ]
)
_PPO_CRITIC = _TRAIN_ENGINE | frozenset({"ppo_n_minibatches", "eps_clip", "mask_no_eos_with_zero"})
_DATASET = frozenset(
    [
        "split",
        "path",
        "type",
        "batch_size",
        "shuffle",
        "pin_memory",
        "num_workers",
        "num_dataset_workers",
        "drop_last",
        "max_length",
        "dataset_kwargs",
        "scheduling_spec",
        "setup_timeout",
    ]
)

#: AReaL field names per block, by the Flywheel path of the block.
AREAL_FIELDS: dict[str, frozenset[str]] = {
    "": frozenset(
        [
            "experiment_name",
            "trial_name",
            "cluster",
            "allocation_mode",
            "seed",
            "enable_offload",
            "total_train_epochs",
            "total_train_steps",
            "total_train_n_seqs",
            "tokenizer_path",
            "train_dataset",
            "valid_dataset",
            "saver",
            "evaluator",
            "stats_logger",
            "perf_tracer",
            "memory_profiler",
            "recover",
            "sglang",
            "vllm",
            "scheduler",
            "post_exit_hook",
            "gconfig",
            "eval_gconfig",
            "rollout",
            "actor",
            "ref",
            "critic",
            "teacher",
            "dynamic_bs",
        ]
    ),
    "cluster": frozenset(
        ["name_resolve", "cluster_name", "fileroot", "n_nodes", "n_gpus_per_node"]
    ),
    "actor": _PPO_ACTOR,
    "ref": _PPO_ACTOR,
    "critic": _PPO_CRITIC,
    "teacher": _TRAIN_ENGINE | frozenset({"engine_type", "rollout", "train", "rl_loss_weight"}),
    "gconfig": frozenset(
        [
            "n_samples",
            "max_new_tokens",
            "min_new_tokens",
            "max_tokens",
            "greedy",
            "top_p",
            "top_k",
            "temperature",
            "stop_token_ids",
            "ignore_eos",
            "skip_special_tokens",
            "stop",
            "frequency_penalty",
            "seed",
            "lora_name",
            "use_beam_search",
            "reward_normalization",
            "drop_incomplete_group",
        ]
    ),
    "rollout": frozenset(
        [
            "experiment_name",
            "trial_name",
            "fileroot",
            "max_concurrent_rollouts",
            "queue_size",
            "consumer_batch_size",
            "max_head_offpolicyness",
            "enable_rollout_tracing",
            "deterministic_sampling",
            "serialize_group_samples",
            "check_trajectory_format",
            "tokenizer_path",
            "dump_to_file",
            "setup_timeout",
            "workers_ready_timeout",
            "request_timeout",
            "request_retries",
            "pause_grace_period",
            "scheduling_spec",
            "backend",
            "scheduling_strategy",
            "use_lora",
            "lora_name",
            "agent",
            "return_routed_experts",
            "_version",
            "model",
            "routing_strategy",
            "poll_interval",
            "admin_api_key",
            "api_url",
            "provider_api_key",
        ]
    ),
    "train_dataset": _DATASET,
    "valid_dataset": _DATASET,
    "optimizer": frozenset(
        [
            "type",
            "lr",
            "weight_decay",
            "beta1",
            "beta2",
            "eps",
            "min_lr_ratio",
            "lr_scheduler_type",
            "warmup_steps_proportion",
            "warmup_steps",
            "initial_loss_scale",
            "min_loss_scale",
            "loss_scale_window",
            "hysteresis",
            "gradient_clipping",
        ]
    ),
    "mb_spec": frozenset(
        ["n_mbs", "granularity", "max_tokens_per_mb", "n_mbs_divisor", "packing_algorithm"]
    ),
    "fsdp": frozenset(
        [
            "wrap_policy",
            "offload_params",
            "memory_efficient_load",
            "per_layer_optim_step",
            "optim_step_prefetch_layers",
            "shard_vision_across_sp",
        ]
    ),
}


def blocks(raw: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
    """The dict blocks of `raw` an AREAL_FIELDS entry applies to (optimizer, mb_spec and
    fsdp sit below each engine block)."""
    if path == "":
        return [("", raw)]
    if path in ("optimizer", "mb_spec", "fsdp"):
        out = []
        for engine in ("actor", "ref", "critic", "teacher"):
            block = raw.get(engine)
            if isinstance(block, dict) and isinstance(block.get(path), dict):
                out.append((f"{engine}.{path}", block[path]))
        return out
    block = raw.get(path)
    return [(path, block)] if isinstance(block, dict) else []
