"""Read a config written for AReaL: translate each AReaL key to its Flywheel meaning.

A file is read as an AReaL config when it holds keys that only AReaL has (`saver`,
`cluster.n_gpus_per_node`, `actor.backend`, ...; see `areal_markers`) or when the user
says so (`flywheel run --from areal`). `translate` then works on the resolved tree
(interpolation done, so `${actor.backend}` has its value) and returns the Flywheel tree
plus one `Translation` row per AReaL key it touched:

- `mapped`: the value now sets a Flywheel key (`actor.backend: fsdp:d4` sets
  `trainer.n_ranks: 4`; `saver.freq_steps` sets `trainer.save_freq_steps`, ...);
- `ignored`: accepted and not used, with the reason (cluster-only and engine-internal keys).

Keys that Flywheel and AReaL share with one meaning pass through untouched. A key known to
neither stays in the tree, so validation reports it (a typo must still fail).

The field names of AReaL's config classes below are those of `areal/api/cli_args.py`
(AReaL 2.0, commit cbff54d): which keys exist, not what they do here.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

from .schema import flywheel_fields

_ABSENT = object()

MAPPED = "mapped"
IGNORED = "ignored"


@dataclass(frozen=True)
class Translation:
    """One AReaL key and what Flywheel does with it."""

    key: str
    """Dotted AReaL key (`actor.backend`)."""

    value: Any
    """The value in the file (after interpolation)."""

    action: str
    """`mapped` (sets the Flywheel keys named in `flywheel`) or `ignored`."""

    flywheel: str
    """What Flywheel does: the keys it sets, or why the key is not used."""


# --------------------------------------------------------------------------- AReaL's names

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

_MERGED = (
    "rollout serves merged weights: the trainer publishes W + (lora_alpha / lora_rank) B A "
    "under the Hugging Face names, so no LoRA serving is needed"
)
#: SGLang server arguments of LoRA serving, kept out of rollout.sglang.launch_args.
_SGLANG_LORA = ("enable_lora", "max_lora_rank", "max_loaded_loras", "lora_paths", "lora_backend")

#: Why a key no Flywheel block models is not used, by the key's last name.
_IGNORE_REASONS: dict[str, str] = {
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
    "lora_name": _MERGED,
    "use_lora": f"{_MERGED} (LoRA training is actor.use_lora)",
    "enable_lora": _MERGED,
    "max_lora_rank": _MERGED,
    "max_loras": _MERGED,
    "max_loaded_loras": _MERGED,
    "lora_paths": _MERGED,
    "lora_modules": _MERGED,
    "lora_backend": _MERGED,
    "serialize_group_samples": "groups travel to the buffer as one message anyway",
    "return_routed_experts": "MoE routing replay is not available",
    "use_beam_search": "the rollout samples; beam search is not available",
    "num_dataset_workers": "prompts are read by the rollout itself, no data service",
    "dataset_kwargs": "the data set loader takes prompt_key / answer_key instead",
    "per_layer_optim_step": "engine-internal FSDP setting; not available",
    "optim_step_prefetch_layers": "engine-internal FSDP setting; not available",
    "shard_vision_across_sp": "engine-internal FSDP setting; not available",
}
_GENERIC_REASON = "engine-internal AReaL setting with no Flywheel equivalent"

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


def areal_hint(path: str) -> str | None:
    """What an AReaL key at dotted `path` is, for a file read as Flywheel's (so that no
    "did you mean" points at a Flywheel key of the same name with another meaning); None
    when `path` is not an AReaL key."""
    if path in COLLISIONS:
        return COLLISIONS[path]
    block, _, key = path.rpartition(".")
    if block == "launcher":
        return COLLISIONS["launcher"]
    names = AREAL_FIELDS.get(block) or AREAL_FIELDS.get(block.rpartition(".")[2])
    if names and key in names:
        reason = _IGNORE_REASONS.get(key, _GENERIC_REASON)
        return f"`{key}` is an AReaL key of {block or 'the root'} ({reason})"
    return None


def areal_markers(raw: dict[str, Any]) -> list[str]:
    """Dotted keys of `raw` that only AReaL has: the evidence that a file is an AReaL
    config. Empty for a Flywheel file."""
    found: list[str] = []
    for path, names in AREAL_FIELDS.items():
        for node_path, node in _blocks(raw, path):
            known = flywheel_fields(node_path)
            if known is None:
                continue
            for key in node:
                if key in names and key not in known:
                    found.append(f"{node_path}.{key}" if node_path else key)
    return sorted(set(found))


def _blocks(raw: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
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


# --------------------------------------------------------------------------- allocations

_DIM = re.compile(r"([dptce])(\d+)")


@dataclass(frozen=True)
class Allocation:
    """One AReaL allocation `backend:dims` (`fsdp:d4p1t1`, `sglang:d2t4`)."""

    backend: str
    dims: dict[str, int]

    @property
    def world(self) -> int:
        """GPUs the allocation spans (d·p·t·c, AReaL's world size)."""
        d = self.dims
        return d.get("d", 1) * d.get("p", 1) * d.get("t", 1) * d.get("c", 1)


def parse_allocation(text: str, default_backend: str) -> Allocation:
    """Parse `backend:dims` (AReaL 2.0) or `backend.dims` (older) or bare `dims`. The
    hybrid MoE form `backend:(attn:d1p6t1c1|ffn:...)` counts the attention part's GPUs."""
    text = text.strip()
    backend, dims_text = default_backend, text
    head = re.match(r"^([a-z_]+)(?:\[[^\]]*\])?[:.](.*)$", text)
    if head:
        backend, dims_text = head.group(1), head.group(2)
    hybrid = re.match(r"^\((?:attn:)?([^|)]*)", dims_text)
    if hybrid:
        dims_text = hybrid.group(1)
    dims = {k: int(v) for k, v in _DIM.findall(dims_text)}
    if not dims:
        raise ValueError(f"cannot read the parallel dimensions of {text!r} (expected e.g. d4p1t1)")
    return Allocation(backend, dims)


# --------------------------------------------------------------------------- translation


def translate(tree: dict[str, Any]) -> tuple[dict[str, Any], list[Translation]]:
    """The Flywheel tree for the resolved AReaL tree `tree`, and what was done per key."""
    t = _Translator(copy.deepcopy(tree))
    t.run()
    return t.out, t.rows


class _Translator:
    def __init__(self, out: dict[str, Any]):
        self.out = out
        self.rows: list[Translation] = []

    # -- tree helpers ----------------------------------------------------------------------

    def pop(self, dotted: str) -> Any:
        node: Any = self.out
        parts = dotted.split(".")
        for part in parts[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
            if not isinstance(node, dict):
                return _ABSENT
        if not isinstance(node, dict) or parts[-1] not in node:
            return _ABSENT
        return node.pop(parts[-1])

    def get(self, dotted: str, default: Any = None) -> Any:
        node: Any = self.out
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def set(self, dotted: str, value: Any) -> None:
        node = self.out
        parts = dotted.split(".")
        for part in parts[:-1]:
            nxt = node.get(part)
            if not isinstance(nxt, dict):
                nxt = {}
                node[part] = nxt
            node = nxt
        node[parts[-1]] = value

    def mapped(self, key: str, value: Any, text: str) -> None:
        self.rows.append(Translation(key, value, MAPPED, text))

    def ignored(self, key: str, value: Any, reason: str) -> None:
        self.rows.append(Translation(key, value, IGNORED, reason))

    def drop(self, key: str, reason: str | None = None) -> Any:
        value = self.pop(key)
        if value is not _ABSENT:
            last = key.rsplit(".", 1)[-1]
            self.ignored(key, value, reason or _IGNORE_REASONS.get(last, _GENERIC_REASON))
        return value

    # -- the rules -------------------------------------------------------------------------

    def run(self) -> None:
        self.gpus_per_node = self.get("cluster.n_gpus_per_node", 8)
        self.allocations()
        self.weight_update()
        self.lora()
        self.names()
        self.checkpoints()
        self.evaluation()
        self.tracking()
        self.sglang()
        self.scheduler()
        self.launcher()
        self.small_keys()
        self.sft()
        self.teacher()
        self.leftovers()

    def allocations(self) -> None:
        n_gpus = self.pop("cluster.n_gpus_per_node")
        gpus = self.gpus_per_node
        if n_gpus is not _ABSENT:
            where = "GPUs: trainer.backend nccl" if gpus else "no GPUs: trainer on CPU (gloo)"
            self.mapped("cluster.n_gpus_per_node", n_gpus, where)
        self.drop("cluster.n_nodes")
        self.drop("cluster.name_resolve")
        train = self.pop("actor.backend")
        infer = self.pop("rollout.backend")
        legacy = self.pop("allocation_mode")
        if legacy not in (_ABSENT, None, ""):
            parts = [p for p in str(legacy).split("+") if p.strip()]
            if infer is _ABSENT and train is _ABSENT and len(parts) == 2:
                infer, train = parts
                self.mapped("allocation_mode", legacy, "read as rollout.backend + actor.backend")
            else:
                self.ignored(
                    "allocation_mode",
                    legacy,
                    "deprecated in AReaL; the per-engine backend fields of this file are used",
                )
        if gpus:
            self.set("trainer.backend", "nccl")
            self.set("trainer.device", "cuda")
        else:
            self.set("trainer.backend", "gloo")
            self.set("trainer.device", "cpu")
            self.set("rollout.torch_device", "cpu")
        if train is not _ABSENT and train is not None:
            alloc = parse_allocation(str(train), "fsdp")
            self.set("trainer.n_ranks", alloc.world)
            if alloc.backend == "fsdp" and alloc.world == alloc.dims.get("d", 1):
                text = f"trainer.n_ranks: {alloc.world} (FSDP2 data parallel)"
            else:
                text = (
                    f"trainer.n_ranks: {alloc.world}: FSDP2 data parallel over the same GPUs "
                    f"({alloc.backend}'s tensor/pipeline/context parallelism is not available)"
                )
            self.mapped("actor.backend", train, text)
        for engine in ("ref", "critic", "teacher"):
            self.drop(
                f"{engine}.backend",
                f"the {engine} runs inside the trainer's ranks (AReaL's colocation with the actor)",
            )
        if infer is not _ABSENT and infer is not None:
            alloc = parse_allocation(str(infer), "sglang")
            replicas = alloc.dims.get("d", 1) * alloc.dims.get("p", 1)
            tp = alloc.dims.get("t", 1)
            if alloc.backend == "sglang" or (alloc.backend == "vllm" and gpus):
                self.set("rollout.engine", "sglang")
                self.set("rollout.sglang.tp_size", tp)
                text = f"rollout.engine: sglang, rollout.n_replicas: {replicas}, rollout.sglang.tp_size: {tp}"
                if alloc.backend == "vllm":
                    text += " (Flywheel has no vLLM engine: SGLang serves the same model)"
            else:
                self.set("rollout.engine", "torch")
                text = (
                    f"rollout.engine: torch, rollout.n_replicas: {replicas} (no GPUs: the "
                    "in-process torch engine; Flywheel has no vLLM engine)"
                )
            self.set("rollout.n_replicas", replicas)
            self.mapped("rollout.backend", infer, text)

    def weight_update(self) -> None:
        mode = self.pop("actor.weight_update_mode")
        for engine in ("ref", "critic"):
            self.drop(f"{engine}.weight_update_mode", "only the actor's weights are published")
        shown = mode
        if mode is _ABSENT:
            mode, shown = "xccl", "(absent: AReaL's default xccl)"
        transport = {"xccl": "distributed", "disk": "disk", "awex": "distributed"}.get(str(mode))
        if transport is None:
            self.ignored(
                "actor.weight_update_mode",
                shown,
                "unknown AReaL mode; trainer.weight_transport keeps its default",
            )
            return
        self.set("trainer.weight_transport", transport)
        text = f"trainer.weight_transport: {transport}"
        if mode == "awex":
            text += " (AWEX is not available; torch.distributed broadcast instead)"
        self.mapped("actor.weight_update_mode", shown, text)

    def lora(self) -> None:
        """AReaL's FSDP LoRA keys have Flywheel's names and meaning: reported as mapped.
        Only trained models get adapters, so a reference model's are reported ignored."""
        for engine in ("actor", "critic"):
            if self.get(f"{engine}.use_lora") is not True:
                continue
            self.mapped(
                f"{engine}.use_lora",
                True,
                f"{engine}.use_lora: LoRA adapters trained with FSDP2, base weights frozen; "
                "rollout serves the merged weights",
            )
            rank = self.get(f"{engine}.lora_rank", 32)  # AReaL's defaults: r 32, alpha 16
            alpha = self.get(f"{engine}.lora_alpha", 16)
            for key in ("peft_type", "lora_rank", "lora_alpha"):
                if self.get(f"{engine}.{key}") is not None:
                    text = f"{engine}.{key}"
                    if key == "lora_alpha":
                        text += f" (update scaled by lora_alpha / lora_rank = {alpha}/{rank})"
                    self.mapped(f"{engine}.{key}", self.get(f"{engine}.{key}"), text)
            modules = self.get(f"{engine}.target_modules")
            if modules is not None:
                every = not modules or list(modules) == ["all-linear"]
                text = f"{engine}.target_modules" + (
                    " (every linear layer but the output head)" if every else ""
                )
                self.mapped(f"{engine}.target_modules", modules, text)
        for engine in ("ref", "teacher"):
            if self.get(f"{engine}.use_lora") is True:
                self.drop(
                    f"{engine}.use_lora",
                    f"the {engine} model is not trained: no adapters (it is the base model)",
                )

    def names(self) -> None:
        root = {
            "experiment_name": self.get("experiment_name"),
            "trial_name": self.get("trial_name"),
            "fileroot": self.get("cluster.fileroot"),
        }
        for block in ("rollout", "saver", "recover", "evaluator", "stats_logger", "perf_tracer"):
            for name, want in root.items():
                key = f"{block}.{name}"
                value = self.pop(key)
                if value is _ABSENT:
                    continue
                where = "cluster.fileroot" if name == "fileroot" else name
                if want is None or value == want:
                    self.ignored(key, value, f"Flywheel takes it from {where}")
                else:
                    self.ignored(
                        key,
                        value,
                        f"differs from {where}={want!r}; Flywheel uses {where} for every path",
                    )

    def checkpoints(self) -> None:
        saver = self.pop("saver")
        recover = self.pop("recover")
        steps: list[int] = []
        for name, block in (("saver", saver), ("recover", recover)):
            if not isinstance(block, dict):
                if block is not _ABSENT and block is not None:
                    self.ignored(name, block, f"AReaL's {name} is a block; not read")
                continue
            freq = block.pop("freq_steps", None)
            if freq:
                steps.append(int(freq))
                self.mapped(
                    f"{name}.freq_steps",
                    freq,
                    "trainer.save_freq_steps (the most frequent of saver and recover)",
                )
            elif freq is None and "freq_steps" not in block:
                pass
            for timer in ("freq_epochs", "freq_secs"):
                value = block.pop(timer, None)
                if value is not None:
                    self.ignored(
                        f"{name}.{timer}",
                        value,
                        "Flywheel checkpoints by trainer step only (trainer.save_freq_steps)",
                    )
        if steps:
            self.set("trainer.save_freq_steps", min(steps))
        if isinstance(saver, dict):
            for key, value in saver.items():
                self.ignored(
                    f"saver.{key}",
                    value,
                    "every checkpoint also writes the HF model (trainer.export_hf), synchronously",
                )
        if isinstance(recover, dict):
            mode = recover.pop("mode", "disabled")
            flywheel = "auto" if str(mode) in ("on", "auto") else "disabled"
            self.set("trainer.recover", flywheel)
            self.mapped("recover.mode", mode, f"trainer.recover: {flywheel}")
            retries = recover.pop("retries", None)
            if retries is not None:
                self.set("launcher.max_restarts", int(retries))
                self.mapped("recover.retries", retries, "launcher.max_restarts (per service)")
            for key, value in recover.items():
                self.ignored(
                    f"recover.{key}", value, "recovery checkpoints always hold the optimizer state"
                )

    def evaluation(self) -> None:
        block = self.pop("evaluator")
        if isinstance(block, dict):
            freq = block.pop("freq_steps", None)
            if freq:
                self.set("launcher.eval.freq_steps", int(freq))
                self.mapped("evaluator.freq_steps", freq, "launcher.eval.freq_steps")
            for key, value in block.items():
                if value is None:
                    continue
                self.ignored(
                    f"evaluator.{key}",
                    value,
                    "Flywheel evaluates before the first "
                    "step, every launcher.eval.freq_steps steps and after the last",
                )
        eval_g = self.pop("eval_gconfig")
        if isinstance(eval_g, dict):
            for key in ("temperature", "max_new_tokens"):
                if eval_g.get(key) is not None:
                    self.set(f"launcher.eval.{key}", eval_g.pop(key))
                    self.mapped(
                        f"eval_gconfig.{key}",
                        self.get(f"launcher.eval.{key}"),
                        f"launcher.eval.{key}",
                    )
            for key, value in eval_g.items():
                self.ignored(
                    f"eval_gconfig.{key}",
                    value,
                    "evaluation samples one answer per prompt with gconfig's other settings",
                )

    def tracking(self) -> None:
        block = self.pop("stats_logger")
        if not isinstance(block, dict):
            return
        wandb = block.pop("wandb", None)
        if isinstance(wandb, dict):
            for key in ("mode", "project", "entity", "name", "job_type", "group", "notes", "tags"):
                if wandb.get(key) is not None:
                    value = wandb.pop(key)
                    self.set(f"tracking.wandb.{key}", value)
                    self.mapped(f"stats_logger.wandb.{key}", value, f"tracking.wandb.{key}")
            for key, value in wandb.items():
                if value in (None, "", {}):
                    continue
                reason = (
                    "read from the environment (WANDB_API_KEY / WANDB_BASE_URL), never from a file"
                    if key in ("wandb_api_key", "wandb_base_url")
                    else "not used by Flywheel's W&B run"
                )
                self.ignored(f"stats_logger.wandb.{key}", "***" if "key" in key else value, reason)
        tb = block.pop("tensorboard", None)
        if isinstance(tb, dict) and tb.get("path"):
            self.set("tracking.tensorboard.path", tb["path"])
            self.mapped("stats_logger.tensorboard.path", tb["path"], "tracking.tensorboard.path")
        for other in ("swanlab", "trackio"):
            value = block.pop(other, None)
            if isinstance(value, dict) and value.get("mode", "disabled") != "disabled":
                self.ignored(
                    f"stats_logger.{other}",
                    value,
                    "not available; TensorBoard (always), W&B and MLflow are (tracking.*)",
                )

    def sglang(self) -> None:
        block = self.pop("sglang")
        if not isinstance(block, dict):
            return
        if self.get("rollout.engine") != "sglang":
            self.ignored("sglang", "{...}", "the rollout engine is not sglang")
            return
        args: dict[str, Any] = {}
        own = {"model_path", "tp_size", "host", "port", "skip_tokenizer_init"}
        for key, value in block.items():
            if key in own:
                self.ignored(f"sglang.{key}", value, "set by the rollout itself")
            elif key in _SGLANG_LORA:
                self.ignored(f"sglang.{key}", value, _MERGED)
            elif value is not None:
                args[key] = value
        launch = self.get("rollout.sglang.launch_args") or {}
        self.set("rollout.sglang.launch_args", {**args, **launch})
        self.mapped(
            "sglang",
            f"{len(args)} arguments",
            f"rollout.sglang.launch_args ({', '.join(sorted(args))})",
        )

    def scheduler(self) -> None:
        block = self.get("scheduler")
        if not isinstance(block, dict):
            return
        kind = block.pop("type", _ABSENT)
        if kind is not _ABSENT:
            self.set("scheduler.type", "local")
            note = (
                "" if kind in (None, "local") else " (use scheduler.type: kubernetes for a cluster)"
            )
            self.mapped("scheduler.type", kind, f"scheduler.type: local{note}")
        for key in list(block):
            if key in (
                "endpoint",
                "deploy_mode",
                "functioncall_service_domain",
                "reward_functioncall_config",
                "reward_model_path",
                "reward_model_service_url",
            ):
                self.ignored(
                    f"scheduler.{key}",
                    block.pop(key),
                    "AReaL single-controller "
                    "setting; Flywheel's services are independent processes",
                )

    def launcher(self) -> None:
        block = self.get("launcher")
        known = flywheel_fields("launcher") or set()
        if isinstance(block, dict):
            for key in [k for k in block if k not in known]:
                self.ignored(f"launcher.{key}", block.pop(key), COLLISIONS["launcher"])

    def sft(self) -> None:
        kind = self.get("train_dataset.type")
        if kind is not None and str(kind) != "rl":
            self.rows.append(
                Translation(
                    "train_dataset.type",
                    kind,
                    IGNORED,
                    f"AReaL trains {kind!r} with another entry point; `flywheel run` trains "
                    "with RL on these prompts, `flywheel sft --config FILE` fine-tunes on "
                    "their answers",
                )
            )

    def small_keys(self) -> None:
        dynamic = self.pop("dynamic_bs")
        if dynamic is not _ABSENT:
            self.set("actor.dynamic_sampling", bool(dynamic))
            self.mapped(
                "dynamic_bs",
                dynamic,
                "actor.dynamic_sampling (groups whose rewards are "
                "all equal are dropped; the batch shrinks as with AReaL's dynamic_bs)",
            )
        agent = self.pop("rollout.agent")
        if isinstance(agent, dict):
            if "turn_discount" in agent:
                value = agent.pop("turn_discount")
                self.set("rollout.turn_discount", value)
                self.mapped("rollout.agent.turn_discount", value, "rollout.turn_discount")
            for key, value in agent.items():
                self.ignored(
                    f"rollout.agent.{key}",
                    value,
                    "AReaL's agent proxy; Flywheel's workflows are rollout.workflow",
                )
        if self.get("actor.rejection_sampling") is not None and not self.get(
            "actor.use_decoupled_loss", False
        ):
            self.drop(
                "actor.rejection_sampling",
                "AReaL ignores it without "
                "use_decoupled_loss (its PPOActorConfig warns so); not applied",
            )
        norm = self.pop("gconfig.reward_normalization")
        if norm is not _ABSENT:
            if norm and self.get("actor.reward_norm") is None:
                group = self.get("gconfig.n_samples", 1)
                self.set(
                    "actor.reward_norm",
                    {"mean_level": "group", "std_level": "group", "group_size": group},
                )
                self.mapped(
                    "gconfig.reward_normalization",
                    norm,
                    "actor.reward_norm: {mean_level: group, std_level: group}",
                )
            else:
                self.ignored(
                    "gconfig.reward_normalization", norm, "off (or actor.reward_norm is set)"
                )

    def teacher(self) -> None:
        """AReaL 2.0's teacher: `train: {...}` (engine_type train) nests the engine fields,
        which TeacherConfig reads as its own (teacher.path wins, as in AReaL); a rollout-engine
        teacher (AReaL's default engine_type) is scored in the trainer instead."""
        block = self.get("teacher")
        if not isinstance(block, dict):
            return
        train = block.get("train")
        if isinstance(train, dict):
            self.mapped(
                "teacher.train",
                train,
                "the teacher block's engine fields (teacher.path wins over train.path, as "
                "in AReaL); its loss settings are not used: the teacher is not trained",
            )
        rollout = block.pop("rollout", None)
        engine = block.get("engine_type")
        if engine == "rollout" or rollout is not None:
            block["engine_type"] = "train"
            self.mapped(
                "teacher.engine_type",
                engine if engine is not None else "rollout",
                "teacher.engine_type: train: the teacher's log-probabilities of the sampled "
                "tokens are computed by a forward pass in the trainer (like ref), not by an "
                "inference server; the same values, on the trainer's ranks",
            )
        if rollout is not None:
            self.ignored(
                "teacher.rollout",
                rollout,
                "the teacher is scored in the trainer (teacher.engine_type: train), not by "
                "an inference engine",
            )

    def leftovers(self) -> None:
        """Every other AReaL-only key: accepted and reported as ignored."""
        handled = {row.key for row in self.rows}
        for path, names in AREAL_FIELDS.items():
            for node_path, node in _blocks(self.out, path):
                known = flywheel_fields(node_path)
                if known is None:
                    continue
                for key in [k for k in node if k in names and k not in known]:
                    dotted = f"{node_path}.{key}" if node_path else key
                    if dotted not in handled:
                        self.drop(dotted)


def format_table(rows: list[Translation]) -> list[str]:
    """The translation as aligned text lines: AReaL key, value, what Flywheel does."""
    if not rows:
        return []
    shown = [(r.key, _short(r.value), f"{r.action}: {r.flywheel}") for r in rows]
    w0 = max(len("AReaL key"), *(len(k) for k, _, _ in shown))
    w1 = min(28, max(len("value"), *(len(v) for _, v, _ in shown)))
    lines = [f"{'AReaL key':<{w0}}  {'value':<{w1}}  Flywheel"]
    lines += [f"{k:<{w0}}  {v:<{w1}}  {t}" for k, v, t in shown]
    return lines


def _short(value: Any) -> str:
    if isinstance(value, dict):
        text = "{" + ", ".join(f"{k}: {_short(v)}" for k, v in list(value.items())[:3])
        return text + (", ...}" if len(value) > 3 else "}")
    if isinstance(value, list):
        if len(value) > 2 or any(isinstance(v, dict | list) for v in value):
            return f"[{len(value)} items]"
        return "[" + ", ".join(_short(v) for v in value) + "]"
    text = "null" if value is None else str(value)
    return text if len(text) <= 28 else text[:25] + "..."
