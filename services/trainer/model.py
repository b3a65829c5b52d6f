"""Load the policy (or critic, or reference) from an HF checkpoint and shard it with FSDP2.

Sharding follows the usual FSDP2 recipe: `fully_shard` on every decoder layer (each layer
becomes one all-gather/reduce-scatter unit, so peak memory holds one unsharded layer at a
time), then on the root (embeddings, final norm, head). The `MixedPrecisionPolicy` casts
parameters to `dtype` for compute and reduces gradients in `grad_reduce_dtype`, while the
sharded master copy and the optimizer states stay in `optimizer_dtype` (fp32 by default).

One rank is sharded too (a 1-rank mesh), so 1 and N ranks run the same code.

A LoRA model (services/trainer/lora.py) is wrapped before sharding: each adapter is a
parameter of its layer and is sharded, gathered and reduced with it; frozen base weights
and trainable adapters share one FSDP2 unit (FSDP2 reduces gradients of the trainable only).
"""

from __future__ import annotations

import logging
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from services.common.config import TrainEngineConfig
from services.common.model_source import auto_model_class, resolve_model_path
from services.trainer.dist import DistContext

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r}: expected one of {sorted(_DTYPES)}") from None


def load_hf_model(cfg: TrainEngineConfig, *, critic: bool = False) -> nn.Module:
    """The HF model of `cfg.path`, in `optimizer_dtype` (the master-weight dtype), on CPU.

    A critic is the same backbone with a one-output token-classification head (the value
    of every prefix); a new head starts from the HF initialisation.
    """
    from transformers import AutoConfig, AutoModelForTokenClassification

    if not cfg.path:
        raise ValueError(
            "actor.path is empty: point it at a Hugging Face checkpoint directory "
            "(the launcher writes the tiny model there for the embedded default)"
        )
    path = resolve_model_path(cfg.path)  # a GGUF source loads from its converted directory
    master = torch_dtype(cfg.optimizer_dtype)
    kwargs: dict[str, Any] = {"attn_implementation": cfg.attn_impl}
    if critic or cfg.is_critic:
        hf_cfg = AutoConfig.from_pretrained(path, num_labels=1)
        if cfg.disable_dropout and hasattr(hf_cfg, "classifier_dropout"):
            hf_cfg.classifier_dropout = 0.0
        if cfg.init_from_scratch:
            model = AutoModelForTokenClassification.from_config(hf_cfg, **kwargs)
        else:
            model = AutoModelForTokenClassification.from_pretrained(
                path, config=hf_cfg, dtype=master, **kwargs
            )
    elif cfg.init_from_scratch:
        model = auto_model_class(path).from_config(AutoConfig.from_pretrained(path), **kwargs)
    else:  # a causal LM, or a vision-language model (image-text-to-text) with its tower
        model = auto_model_class(path).from_pretrained(path, dtype=master, **kwargs)
    model = model.to(master)
    if cfg.disable_dropout:
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
    if getattr(model.config, "use_cache", False):
        model.config.use_cache = False  # training forwards never reuse a KV cache
    if cfg.gradient_checkpointing and cfg.optimizer is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _layer_classes(model: nn.Module, cfg: TrainEngineConfig) -> set[str]:
    policy = cfg.fsdp.wrap_policy
    if policy is not None and policy.transformer_layer_cls_to_wrap:
        return set(policy.transformer_layer_cls_to_wrap)
    names = getattr(model, "_no_split_modules", None) or []
    if not names:
        raise ValueError(
            f"{type(model).__name__} names no decoder layer class; set "
            "fsdp.wrap_policy.transformer_layer_cls_to_wrap"
        )
    return set(names)


def shard_model(model: nn.Module, ctx: DistContext, cfg: TrainEngineConfig) -> nn.Module:
    """Move to the rank's device and apply FSDP2: each decoder layer, then the root."""
    mp = MixedPrecisionPolicy(
        param_dtype=torch_dtype(cfg.dtype),
        reduce_dtype=torch_dtype(cfg.grad_reduce_dtype),
        output_dtype=None,
        cast_forward_inputs=True,
    )
    extra: dict[str, Any] = {"mesh": ctx.mesh, "mp_policy": mp}
    if cfg.fsdp.offload_params and ctx.device.type == "cuda":
        extra["offload_policy"] = CPUOffloadPolicy()
    else:
        model = model.to(ctx.device)
    classes = _layer_classes(model, cfg)
    layers = [m for m in model.modules() if type(m).__name__ in classes]
    if not layers:
        raise ValueError(f"no module of class {sorted(classes)} in {type(model).__name__}")
    for layer in layers:
        fully_shard(layer, **extra)
    fully_shard(model, **extra)
    log.info(
        "fsdp2 sharded",
        extra={"layers": len(layers), "world_size": ctx.world_size, "dtype": cfg.dtype},
    )
    return model


def parameter_names(model: nn.Module) -> list[str]:
    """Names a weight update carries: `named_parameters()` (tied weights once)."""
    return [name for name, _ in model.named_parameters()]


def full_state_dict(model: nn.Module, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Unsharded parameters on CPU, on rank 0 only (others get {}). Collective: every rank
    must call it. Restricted to `names` (the update's parameter set) when given."""
    sd = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if names is not None and sd:
        missing = [n for n in names if n not in sd]
        if missing:
            raise KeyError(f"full state dict lacks parameters {missing[:3]}")
        sd = {n: sd[n] for n in names}
    return cast(dict[str, torch.Tensor], sd)


def load_full_state_dict(model: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """Inverse of `full_state_dict` (rank 0's tensors are broadcast into the shards)."""
    set_model_state_dict(
        model,
        cast(dict[str, Any], sd),
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False),
    )
