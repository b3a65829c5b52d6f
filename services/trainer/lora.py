"""LoRA adapters for the trainer: low-rank updates on frozen linear layers.

A LoRA layer computes `y = x W^T + b + (alpha / r) · (x A^T) B^T` with the base weight `W`
(`[out, in]`) and bias frozen, and two trainable factors `A` (`[r, in]`) and `B`
(`[out, r]`) (Hu et al. 2021, "LoRA", eq. 3; the alpha/r scale is PEFT's
`LoraLayer.scaling`). `A` starts as `nn.Linear` initialises a weight (Kaiming uniform with
a = sqrt(5), PEFT's default `init_lora_weights=True`) and `B` at zero, so the adapted model
computes exactly what the base model computes until the first optimizer step.

`LoRALinear` is an `nn.Linear` that keeps the base layer's `weight` and `bias`
parameters under their own names and adds `lora_A` / `lora_B` beside them. The model's
state dict therefore holds every Hugging Face name unchanged plus one
`<layer>.lora_A` / `<layer>.lora_B` pair per adapted layer, and `merge_lora` turns it back
into a plain Hugging Face state dict (`W + (alpha / r) · B @ A` under `<layer>.weight`).
That merged dict is what the trainer publishes to rollout and exports: rollout engines
serve an ordinary model and need no LoRA support.

`target_modules` follows AReaL's `TrainEngineConfig.target_modules` (read by
`FSDPEngine._apply_peft_wrapper` in areal/engine/fsdp_engine.py): empty or `["all-linear"]`
means every `nn.Linear` except the output head (PEFT's "all-linear"); otherwise a list of
module names, a module matching a name when its dotted path equals it or ends with
`.name` (PEFT's suffix match: `q_proj` adapts every layer's `self_attn.q_proj`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

ALL_LINEAR = "all-linear"
ADAPTER_SUFFIXES = (".lora_A", ".lora_B")
INIT_SEED = 0
"""Seed of the generator that draws every `A`: each rank builds the same adapters (FSDP2
then keeps its own shard of them) without a broadcast, and a run is reproducible."""


class LoRALinear(nn.Linear):
    """A frozen `nn.Linear` plus a trainable rank-`rank` update scaled by `alpha / rank`."""

    def __init__(
        self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator
    ) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: the base layer's parameters are reused
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.rank = rank
        self.scaling = alpha / rank
        dtype, device = base.weight.dtype, base.weight.device
        a = torch.empty(rank, base.in_features, dtype=torch.float32)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        self.lora_A = nn.Parameter(a.to(dtype=dtype, device=device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
        return base + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scaling={self.scaling:g}"


def output_heads(model: nn.Module) -> set[str]:
    """Dotted names of the model's output heads: the LM head (`get_output_embeddings`)
    and a token-classification head (`score` / `classifier`, the critic's value head)."""
    names: set[str] = set()
    get_out = getattr(model, "get_output_embeddings", None)
    out = get_out() if callable(get_out) else None
    for name, module in model.named_modules():
        is_lm_head = out is not None and module is out
        is_value_head = name in ("score", "classifier") and isinstance(module, nn.Linear)
        if is_lm_head or is_value_head:
            names.add(name)
    return names


def _matches(name: str, targets: list[str]) -> bool:
    return any(name == t or name.endswith("." + t) for t in targets)


def select_targets(model: nn.Module, target_modules: Iterable[str]) -> list[str]:
    """Dotted names of the linear layers `target_modules` names (see the module docstring).

    Raises when a listed name matches no module, or matches one that is not an
    `nn.Linear` (only linear layers get adapters)."""
    targets = [t for t in target_modules]
    heads = output_heads(model)
    modules = dict(model.named_modules())
    if not targets or targets == [ALL_LINEAR]:
        chosen = [
            n for n, m in modules.items() if isinstance(m, nn.Linear) and n and n not in heads
        ]
        if not chosen:
            raise ValueError(f"{type(model).__name__} has no linear layer besides its head")
        return chosen
    chosen = []
    for name, module in modules.items():
        if not name or not _matches(name, targets):
            continue
        if not isinstance(module, nn.Linear):
            raise ValueError(
                f"target_modules: {name!r} is a {type(module).__name__}, not a linear layer; "
                "LoRA adapts nn.Linear layers only"
            )
        chosen.append(name)
    found = {t for t in targets if any(_matches(n, [t]) for n in chosen)}
    missing = [t for t in targets if t not in found]
    if missing:
        linear = sorted(
            {n.rsplit(".", 1)[-1] for n, m in modules.items() if isinstance(m, nn.Linear)}
        )
        raise ValueError(
            f"target_modules {missing} match no module of {type(model).__name__}; "
            f"its linear layers are named {linear}"
        )
    return chosen


def apply_lora(
    model: nn.Module,
    *,
    rank: int,
    alpha: float,
    target_modules: Iterable[str],
    trainable: Iterable[str] = (),
) -> dict[str, float]:
    """Replace the targeted linear layers of `model` by `LoRALinear`s (before sharding)
    and freeze every other parameter except those under the module names in `trainable`
    (a critic's freshly initialised value head). Returns `{layer name: alpha / rank}`."""
    names = select_targets(model, target_modules)
    generator = torch.Generator().manual_seed(INIT_SEED)
    for p in model.parameters():
        p.requires_grad_(False)
    adapters: dict[str, float] = {}
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        base = getattr(parent, child)
        layer = LoRALinear(base, rank, alpha, generator)
        setattr(parent, child, layer)
        adapters[name] = layer.scaling
    for name in trainable:
        for p in model.get_submodule(name).parameters():
            p.requires_grad_(True)
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_all = sum(p.numel() for p in model.parameters())
    log.info(
        "lora adapters",
        extra={"layers": len(adapters), "rank": rank, "trainable": n_train, "total": n_all},
    )
    return adapters


def is_adapter(name: str) -> bool:
    """Whether a state-dict key is a LoRA factor (`<layer>.lora_A` / `<layer>.lora_B`)."""
    return name.endswith(ADAPTER_SUFFIXES)


def merge_lora(
    state_dict: dict[str, torch.Tensor], adapters: dict[str, float]
) -> dict[str, torch.Tensor]:
    """A plain Hugging Face state dict from one with adapters: `<layer>.weight` becomes
    `W + scale · B @ A` (computed in float32, stored in W's dtype) and the adapter keys
    go. Other tensors are passed through (not copied)."""
    out = {k: v for k, v in state_dict.items() if not is_adapter(k)}
    for layer, scale in adapters.items():
        w = state_dict[f"{layer}.weight"]
        a = state_dict[f"{layer}.lora_A"].float()
        b = state_dict[f"{layer}.lora_B"].float()
        out[f"{layer}.weight"] = (w.float() + scale * (b @ a)).to(w.dtype)
    return out
