"""Why an AReaL key is not used, and what an AReaL key means when it collides with a
Flywheel key of the same name: the texts of the translation table and of "did you mean"."""

from __future__ import annotations

MERGED = (
    "rollout serves merged weights: the trainer publishes W + (lora_alpha / lora_rank) B A "
    "under the Hugging Face names, so no LoRA serving is needed"
)
#: SGLang server arguments of LoRA serving, kept out of rollout.sglang.launch_args.
SGLANG_LORA = ("enable_lora", "max_lora_rank", "max_loaded_loras", "lora_paths", "lora_backend")

#: Why a key no Flywheel block models is not used, by the key's last name.
IGNORE_REASONS: dict[str, str] = {
    "scheduling_spec": "per-worker resources; Flywheel's scheduler places the services "
    "(local processes, or the Helm chart's resources)",
    "scheduling_strategy": "colocation is how Flywheel runs ref and critic anyway: inside "
    "the trainer's ranks",
    "name_resolve": "services find each other at the addresses under `services`",
    "n_nodes": "cluster size: Flywheel's scheduler places the services",
    "enable_offload": "rollout and trainer hold their own devices; nothing to offload between them",
    "perf_tracer": "profiling: every service exports Prometheus metrics at /metrics",
    "memory_profiler": "profiling: every service exports Prometheus metrics at /metrics",
    "vllm": "Flywheel has no vLLM engine (rollout.engine is torch or sglang)",
    "post_exit_hook": "the launcher runs no hook after exit",
    "total_train_n_seqs": "Flywheel stops on total_train_steps or total_train_epochs",
    "megatron": "Flywheel trains with FSDP2; Megatron settings do not apply",
    "archon": "Flywheel trains with FSDP2; Archon settings do not apply",
    "use_kernels": "engine-internal (Hugging Face kernels); not available",
    "enable_tree_training": "engine-internal (tree attention); not available",
    "enable_delta_weight_update": "AWEX delta updates; Flywheel sends whole weights",
    "weight_update_delta_method": "AWEX delta updates; Flywheel sends whole weights",
    "weight_update_anchor_interval": "AWEX delta updates; Flywheel sends whole weights",
    "lora_name": MERGED,
    "use_lora": f"{MERGED} (LoRA training is actor.use_lora)",
    "enable_lora": MERGED,
    "max_lora_rank": MERGED,
    "max_loras": MERGED,
    "max_loaded_loras": MERGED,
    "lora_paths": MERGED,
    "lora_modules": MERGED,
    "lora_backend": MERGED,
    "serialize_group_samples": "groups travel to the buffer as one message anyway",
    "return_routed_experts": "MoE routing replay is not available",
    "use_beam_search": "the rollout samples; beam search is not available",
    "num_dataset_workers": "prompts are read by the rollout itself, no data service",
    "dataset_kwargs": "the data set loader takes prompt_key / answer_key instead",
    "per_layer_optim_step": "engine-internal FSDP setting; not available",
    "optim_step_prefetch_layers": "engine-internal FSDP setting; not available",
    "shard_vision_across_sp": "engine-internal FSDP setting; not available",
}
GENERIC_REASON = "engine-internal AReaL setting with no Flywheel equivalent"

#: AReaL keys whose name is also a Flywheel key (or close to one) with another meaning:
#: a Flywheel file that uses them gets this text instead of a "did you mean".
COLLISIONS: dict[str, str] = {
    "recover": "AReaL's `recover` block (mode, freq_*); Flywheel's recovery is "
    "trainer.recover: auto|disabled",
    "saver": "AReaL's `saver` block; Flywheel's checkpoints are trainer.save_freq_steps",
    "evaluator": "AReaL's `evaluator` block; Flywheel's evaluation is launcher.eval",
    "stats_logger": "AReaL's `stats_logger` block; Flywheel's is `tracking`",
    "sglang": "AReaL's SGLang server arguments; Flywheel's are rollout.sglang.launch_args",
    "actor.backend": "AReaL's train allocation (`fsdp:d4`); Flywheel's ranks are "
    "trainer.n_ranks (trainer.backend is the torch.distributed backend)",
    "ref.backend": "AReaL's allocation of the reference model; Flywheel runs it in the "
    "trainer's ranks",
    "critic.backend": "AReaL's allocation of the critic; Flywheel runs it in the trainer's ranks",
    "rollout.backend": "AReaL's inference allocation (`sglang:d4t1`); Flywheel's are "
    "rollout.engine, rollout.n_replicas and rollout.sglang.tp_size",
    "actor.weight_update_mode": "AReaL's weight sync (xccl|disk); Flywheel's is "
    "trainer.weight_transport (distributed|disk|grpc)",
    "launcher": "AReaL's launcher resources; Flywheel's `launcher` block is its local launcher",
}


def ignore_reason(key: str) -> str:
    """Why the AReaL key `key` (dotted or bare) is not used, by its last name."""
    return IGNORE_REASONS.get(key.rsplit(".", 1)[-1], GENERIC_REASON)
