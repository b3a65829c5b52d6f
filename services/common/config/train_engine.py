"""`TrainEngineConfig`: what every trained model shares (the policy, the critic, a teacher):
its path, precision, micro-batches, FSDP wrapping, gradient checkpointing and optimizer.

AReaL's `TrainEngineConfig` with its field names and defaults; the actor's, critic's and
teacher's blocks extend it (`actor.py`).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator

from ._base import FlywheelModel, RuleViolation
from .optimizer import OptimizerConfig

DType = Literal["float32", "bfloat16", "float16"]

_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_MODULE_NAME = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")


class MicroBatchSpec(FlywheelModel):
    """How one minibatch is split into micro-batches for forward/backward."""

    n_mbs: int | None = Field(default=1, ge=1)
    """Number of micro-batches; the minimum number when `max_tokens_per_mb` is set."""

    granularity: int = Field(default=1, ge=1)
    """Adjacent sequences are kept together in units of this size when splitting
    (set it to the group size to keep groups whole)."""

    max_tokens_per_mb: int | None = Field(default=None, ge=1)
    """Most tokens in one micro-batch; bounds activation memory for long sequences."""

    n_mbs_divisor: int = Field(default=1, ge=1)
    """The final number of micro-batches is rounded up to a multiple of this."""

    packing_algorithm: Literal["ffd"] = "ffd"
    """Bin packing of sequences into micro-batches: first-fit-decreasing. AReaL's `kk`
    (Karmarkar-Karp) is refused at load: the trainer does not implement it."""

    @field_validator("packing_algorithm", mode="before")
    @classmethod
    def _packing(cls, value: Any) -> Any:
        if value == "kk":
            raise RuleViolation(
                "packing_algorithm",
                value,
                "Karmarkar-Karp packing is not implemented by the trainer; use "
                "packing_algorithm: ffd (first-fit-decreasing, the default)",
            )
        return value


class FSDPWrapPolicy(FlywheelModel):
    """Which module classes become FSDP units."""

    transformer_layer_cls_to_wrap: list[str] | None = None
    """Class names to shard as units; null means the model's decoder layer class."""


class FSDPEngineConfig(FlywheelModel):
    """FSDP2 (`fully_shard`) options of a training engine."""

    wrap_policy: FSDPWrapPolicy | None = None
    """Layer wrapping; null shards each transformer decoder layer."""

    offload_params: bool = False
    """Keep sharded parameters on CPU between uses."""

    memory_efficient_load: bool = False
    """Only rank 0 reads the checkpoint; the others receive shards after sharding."""


class TrainEngineConfig(FlywheelModel):
    """A model that the trainer holds: where it comes from and how it is run.

    Used as is for the reference model (`ref`) and as the base of the actor and critic.
    """

    experiment_name: str | None = None
    """Accepted for AReaL compatibility; the root `experiment_name` is what Flywheel uses."""

    trial_name: str | None = None
    """Accepted for AReaL compatibility; the root `trial_name` is what Flywheel uses."""

    path: str = ""
    """Hugging Face checkpoint directory or hub name; empty means the tiny model that
    the launcher writes locally (embedded default)."""

    attn_impl: str = "sdpa"
    """transformers attention implementation. Flywheel: defaults to `sdpa` (AReaL:
    `flash_attention_2`), which runs everywhere including CPU; set flash_attention_2
    on GPUs that have flash-attn."""

    init_from_scratch: bool = False
    """Randomly initialise the weights instead of loading them."""

    is_critic: bool = False
    """The model has a scalar value head instead of the LM head."""

    temperature: float = Field(default=1.0, gt=0.0)
    """Logits are divided by this before log-probabilities are taken; must equal
    `gconfig.temperature` so that π_θ and π_behave are the same distribution family."""

    logprobs_chunk_size: int = Field(default=1024, ge=1)
    """Tokens per chunk when log-probabilities and entropy are computed (bounds memory)."""

    mb_spec: MicroBatchSpec = Field(default_factory=MicroBatchSpec)
    """Micro-batch splitting of each forward/backward."""

    pad_to_maximum: bool = False
    """Pad every micro-batch to the `mb_spec` bound (less fragmentation, slower)."""

    disable_dropout: bool = False
    """Turn dropout off while training (RL wants π_θ deterministic given the weights)."""

    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""

    dtype: DType = "bfloat16"
    """Compute dtype of forward/backward."""

    grad_reduce_dtype: DType = "float32"
    """Dtype of gradient reduction across data-parallel ranks."""

    optimizer_dtype: Literal["float32", "bfloat16"] = "float32"
    """Storage dtype of parameters and optimizer states (fp32 master weights by default)."""

    optimizer: OptimizerConfig | None = None
    """Optimizer; null means the model is not trained (reference models)."""

    fsdp: FSDPEngineConfig = Field(default_factory=FSDPEngineConfig)
    """FSDP2 options."""

    offload: bool = False
    """Offload parameters and optimizer states to CPU between steps."""

    use_lora: bool = False
    """Train LoRA adapters instead of the full weights (AReaL's FSDP LoRA): the layers
    `target_modules` names get trainable low-rank factors A, B and their weights stay
    frozen; the optimizer holds only the adapters (and a critic's value head). Rollout
    receives the merged weights `W + (lora_alpha / lora_rank) · B @ A` under the Hugging
    Face names, so it needs no LoRA support (AReaL instead sends the adapter alone and
    the inference server applies it). Checkpoints hold base and adapters; the HF export is the merged model.
    Only a trained model (one with an optimizer) gets adapters."""

    lora_rank: int = Field(default=32, ge=1)
    """LoRA rank r: the inner size of the update B @ A (B is out x r, A is r x in)."""

    lora_alpha: int = Field(default=16, ge=1)
    """LoRA alpha: the update is scaled by lora_alpha / lora_rank (PEFT's scaling)."""

    target_modules: list[str] = Field(default_factory=list)
    """Layers that get adapters: empty or `[all-linear]` is every linear layer except the
    output head (PEFT's `all-linear`, AReaL's default); otherwise module names matched as
    suffixes of the dotted path (`q_proj` adapts every `...self_attn.q_proj`). A name that
    matches no linear layer fails when the model is built."""

    peft_type: Literal["lora"] = "lora"
    """PEFT method; only LoRA (as AReaL)."""

    @field_validator("target_modules")
    @classmethod
    def _target_modules(cls, value: list[str]) -> list[str]:
        for name in value:
            if name == "all-linear":
                if len(value) > 1:
                    raise RuleViolation(
                        "target_modules",
                        value,
                        "all-linear already names every linear layer; give it alone or "
                        "list module names without it",
                    )
            elif not _MODULE_NAME.fullmatch(name):
                raise RuleViolation(
                    "target_modules",
                    value,
                    f"{name!r} is not a module name: expected all-linear or dotted names "
                    "such as q_proj or self_attn.o_proj",
                )
        return value

    @field_validator("dtype", "grad_reduce_dtype", "optimizer_dtype", mode="before")
    @classmethod
    def _dtype_alias(cls, value: Any) -> Any:
        # fp32/bf16/fp16 are what people type; store the torch names.
        if isinstance(value, str):
            return _DTYPE_ALIASES.get(value.strip().lower(), value)
        return value
