"""Translation rules for where things run: AReaL's allocations and cluster size, the weight
update mode, LoRA, and the inference server's and scheduler's settings."""

from __future__ import annotations

from typing import Any

from ..schema import flywheel_fields
from .allocation import parse_allocation
from .reasons import COLLISIONS, MERGED, SGLANG_LORA
from .tree import ABSENT, TreeEditor


def allocations(t: TreeEditor) -> None:
    """AReaL's cluster size and allocation strings: `trainer.n_ranks`, the rollout
    engine, its replicas and tensor parallelism, and GPU or CPU from n_gpus_per_node."""
    gpus = t.get("cluster.n_gpus_per_node", 8)  # AReaL's default: 8 GPUs per node
    n_gpus = t.pop("cluster.n_gpus_per_node")
    if n_gpus is not ABSENT:
        where = "GPUs: trainer.backend nccl" if gpus else "no GPUs: trainer on CPU (gloo)"
        t.mapped("cluster.n_gpus_per_node", n_gpus, where)
    t.drop("cluster.n_nodes")
    t.drop("cluster.name_resolve")
    train = t.pop("actor.backend")
    infer = t.pop("rollout.backend")
    legacy = t.pop("allocation_mode")
    if legacy not in (ABSENT, None, ""):
        parts = [p for p in str(legacy).split("+") if p.strip()]
        if infer is ABSENT and train is ABSENT and len(parts) == 2:
            infer, train = parts
            t.mapped("allocation_mode", legacy, "read as rollout.backend + actor.backend")
        else:
            t.ignored(
                "allocation_mode",
                legacy,
                "deprecated in AReaL; the per-engine backend fields of this file are used",
            )
    if gpus:
        t.set("trainer.backend", "nccl")
        t.set("trainer.device", "cuda")
    else:
        t.set("trainer.backend", "gloo")
        t.set("trainer.device", "cpu")
        t.set("rollout.torch_device", "cpu")
    if train is not ABSENT and train is not None:
        alloc = parse_allocation(str(train), "fsdp")
        t.set("trainer.n_ranks", alloc.world)
        if alloc.backend == "fsdp" and alloc.world == alloc.dims.get("d", 1):
            text = f"trainer.n_ranks: {alloc.world} (FSDP2 data parallel)"
        else:
            text = (
                f"trainer.n_ranks: {alloc.world}: FSDP2 data parallel over the same GPUs "
                f"({alloc.backend}'s tensor/pipeline/context parallelism is not available)"
            )
        t.mapped("actor.backend", train, text)
    for engine in ("ref", "critic", "teacher"):
        t.drop(
            f"{engine}.backend",
            f"the {engine} runs inside the trainer's ranks (AReaL's colocation with the actor)",
        )
    if infer is not ABSENT and infer is not None:
        alloc = parse_allocation(str(infer), "sglang")
        replicas = alloc.dims.get("d", 1) * alloc.dims.get("p", 1)
        tp = alloc.dims.get("t", 1)
        if alloc.backend == "sglang" or (alloc.backend == "vllm" and gpus):
            t.set("rollout.engine", "sglang")
            t.set("rollout.sglang.tp_size", tp)
            text = f"rollout.engine: sglang, rollout.n_replicas: {replicas}, rollout.sglang.tp_size: {tp}"
            if alloc.backend == "vllm":
                text += " (Flywheel has no vLLM engine: SGLang serves the same model)"
        else:
            t.set("rollout.engine", "torch")
            text = (
                f"rollout.engine: torch, rollout.n_replicas: {replicas} (no GPUs: the "
                "in-process torch engine; Flywheel has no vLLM engine)"
            )
        t.set("rollout.n_replicas", replicas)
        t.mapped("rollout.backend", infer, text)


def weight_update(t: TreeEditor) -> None:
    """`actor.weight_update_mode` (xccl, disk, awex) as `trainer.weight_transport`."""
    mode = t.pop("actor.weight_update_mode")
    for engine in ("ref", "critic"):
        t.drop(f"{engine}.weight_update_mode", "only the actor's weights are published")
    shown = mode
    if mode is ABSENT:
        mode, shown = "xccl", "(absent: AReaL's default xccl)"
    transport = {"xccl": "distributed", "disk": "disk", "awex": "distributed"}.get(str(mode))
    if transport is None:
        t.ignored(
            "actor.weight_update_mode",
            shown,
            "unknown AReaL mode; trainer.weight_transport keeps its default",
        )
        return
    t.set("trainer.weight_transport", transport)
    text = f"trainer.weight_transport: {transport}"
    if mode == "awex":
        text += " (AWEX is not available; torch.distributed broadcast instead)"
    t.mapped("actor.weight_update_mode", shown, text)


def lora(t: TreeEditor) -> None:
    """AReaL's FSDP LoRA keys have Flywheel's names and meaning: reported as mapped.
    Only trained models get adapters, so a reference model's are reported ignored."""
    for engine in ("actor", "critic"):
        if t.get(f"{engine}.use_lora") is not True:
            continue
        t.mapped(
            f"{engine}.use_lora",
            True,
            f"{engine}.use_lora: LoRA adapters trained with FSDP2, base weights frozen; "
            "rollout serves the merged weights",
        )
        rank = t.get(f"{engine}.lora_rank", 32)  # AReaL's defaults: r 32, alpha 16
        alpha = t.get(f"{engine}.lora_alpha", 16)
        for key in ("peft_type", "lora_rank", "lora_alpha"):
            if t.get(f"{engine}.{key}") is not None:
                text = f"{engine}.{key}"
                if key == "lora_alpha":
                    text += f" (update scaled by lora_alpha / lora_rank = {alpha}/{rank})"
                t.mapped(f"{engine}.{key}", t.get(f"{engine}.{key}"), text)
        modules = t.get(f"{engine}.target_modules")
        if modules is not None:
            every = not modules or list(modules) == ["all-linear"]
            text = f"{engine}.target_modules" + (
                " (every linear layer but the output head)" if every else ""
            )
            t.mapped(f"{engine}.target_modules", modules, text)
    for engine in ("ref", "teacher"):
        if t.get(f"{engine}.use_lora") is True:
            t.drop(
                f"{engine}.use_lora",
                f"the {engine} model is not trained: no adapters (it is the base model)",
            )


def sglang(t: TreeEditor) -> None:
    """AReaL's SGLang server arguments as `rollout.sglang.launch_args` (the ones the
    rollout sets itself, and LoRA serving, are reported ignored)."""
    block = t.pop("sglang")
    if not isinstance(block, dict):
        return
    if t.get("rollout.engine") != "sglang":
        t.ignored("sglang", "{...}", "the rollout engine is not sglang")
        return
    args: dict[str, Any] = {}
    own = {"model_path", "tp_size", "host", "port", "skip_tokenizer_init"}
    for key, value in block.items():
        if key in own:
            t.ignored(f"sglang.{key}", value, "set by the rollout itself")
        elif key in SGLANG_LORA:
            t.ignored(f"sglang.{key}", value, MERGED)
        elif value is not None:
            args[key] = value
    launch = t.get("rollout.sglang.launch_args") or {}
    t.set("rollout.sglang.launch_args", {**args, **launch})
    t.mapped(
        "sglang",
        f"{len(args)} arguments",
        f"rollout.sglang.launch_args ({', '.join(sorted(args))})",
    )


def scheduler(t: TreeEditor) -> None:
    """AReaL's scheduler block: only its type carries over (local)."""
    block = t.get("scheduler")
    if not isinstance(block, dict):
        return
    kind = block.pop("type", ABSENT)
    if kind is not ABSENT:
        t.set("scheduler.type", "local")
        note = "" if kind in (None, "local") else " (use scheduler.type: kubernetes for a cluster)"
        t.mapped("scheduler.type", kind, f"scheduler.type: local{note}")
    for key in list(block):
        if key in (
            "endpoint",
            "deploy_mode",
            "functioncall_service_domain",
            "reward_functioncall_config",
            "reward_model_path",
            "reward_model_service_url",
        ):
            t.ignored(
                f"scheduler.{key}",
                block.pop(key),
                "AReaL single-controller setting; Flywheel's services are independent processes",
            )


def launcher(t: TreeEditor) -> None:
    """AReaL's launcher resources under Flywheel's `launcher` block: reported ignored."""
    block = t.get("launcher")
    known = flywheel_fields("launcher") or set()
    if isinstance(block, dict):
        for key in [k for k in block if k not in known]:
            t.ignored(f"launcher.{key}", block.pop(key), COLLISIONS["launcher"])
