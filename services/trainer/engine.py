"""One FSDP2-sharded model with its optimizer and schedule, and its micro-batch forward.

Used three ways: the actor (trained, log-probabilities), the critic (trained, values) and
the reference model (frozen, log-probabilities). Forward passes take right-padded
micro-batches; an empty micro-batch runs a one-token dummy so that every rank still
joins the FSDP all-gathers (and, in training, the reduce-scatters).
"""

from __future__ import annotations

import inspect
import math
import warnings
from typing import Any

import torch
from torch import nn

from services.common.config import TrainEngineConfig
from services.common.vision_inputs import is_vision_config, load_vision_processor
from services.trainer.batch import SeqBatch
from services.trainer.dist import DistContext
from services.trainer.logprobs import first_scored_position, token_logprobs
from services.trainer.lora import apply_lora, merge_lora, output_heads
from services.trainer.model import (
    full_state_dict,
    load_hf_model,
    parameter_names,
    shard_model,
)
from services.trainer.optim import build_optimizer, build_scheduler
from services.trainer.vision import VisionBatcher, freeze_vision_tower

# The critic's head output is a view; nothing here modifies a model output in place (values
# are built out of place), which is what this FSDP2 warning is about.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


class TrainEngine:
    """A sharded HF model; trainable when `cfg.optimizer` is set and `total_steps` given."""

    def __init__(
        self,
        cfg: TrainEngineConfig,
        ctx: DistContext,
        *,
        critic: bool = False,
        total_steps: int | None = None,
        temperature: float = 1.0,
    ) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.critic = critic
        self.temperature = temperature
        hf = load_hf_model(cfg, critic=critic)
        self.hf_config = hf.config
        self.param_names = parameter_names(hf)
        # HF causal LMs take `logits_to_keep` (the head runs on the last positions only);
        # a model without it gets the head on every position.
        self._head_on_suffix = "logits_to_keep" in inspect.signature(hf.forward).parameters
        self.trainable = cfg.optimizer is not None
        # A vision-language model: images become pixel inputs per micro-batch; a frozen
        # tower (actor.freeze_vision_tower) is left out of weight updates.
        self.vision: VisionBatcher | None = None
        self.frozen_names: frozenset[str] = frozenset()
        if is_vision_config(hf.config):
            self.vision = VisionBatcher(load_vision_processor(cfg.path))
            if getattr(cfg, "freeze_vision_tower", False):
                self.frozen_names = frozenset(freeze_vision_tower(hf))
        # LoRA (actor.use_lora): adapters wrap the target layers before sharding, so FSDP2
        # shards them with their layer; only they (and a critic's new head) are trained.
        # A frozen model has nothing to adapt: B = 0 would leave it the base model.
        self.lora: dict[str, float] = {}
        if cfg.use_lora and self.trainable:
            self.lora = apply_lora(
                hf,
                rank=cfg.lora_rank,
                alpha=cfg.lora_alpha,
                target_modules=cfg.target_modules,
                trainable=output_heads(hf) if critic or cfg.is_critic else (),
            )
            tower = {n.rsplit(".", 1)[0] for n in self.frozen_names}
            adapted = sorted(n for n in self.lora if n in tower)
            if adapted:  # an adapter there would train the tower that updates leave out
                raise ValueError(
                    f"actor.freeze_vision_tower with LoRA target_modules that match the "
                    f"vision tower ({adapted[:3]}); name the language model's layers "
                    "(e.g. self_attn.q_proj, self_attn.v_proj) or unfreeze the tower"
                )
        self.module: nn.Module = shard_model(hf, ctx, cfg)
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        if self.trainable:
            assert cfg.optimizer is not None
            if total_steps is None:
                raise ValueError("a trained model needs the schedule's total optimizer steps")
            self.optimizer = build_optimizer(self.module.parameters(), cfg.optimizer)
            self.scheduler = build_scheduler(self.optimizer, cfg.optimizer, total_steps)
            self.module.train()
        else:
            for p in self.module.parameters():
                p.requires_grad_(False)
            self.module.eval()

    # -- forward ---------------------------------------------------------------------------
    def _inputs(self, mb: SeqBatch | None) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.ctx.device
        if mb is None or mb.size == 0:
            if self.vision is not None:  # the dummy runs the vision tower's FSDP units too
                ids, attn, _ = self.vision.dummy(dev)
                return ids, attn
            return (
                torch.zeros((1, 1), dtype=torch.long, device=dev),
                torch.ones((1, 1), dtype=torch.long, device=dev),
            )
        return mb.input_ids.to(dev), mb.attention_mask.to(dev).long()

    def logits(self, mb: SeqBatch | None, *, first_position: int = 0) -> torch.Tensor:
        """The model's outputs `[b, t - first_position, ...]` at positions
        `first_position` onwards (the head skips the earlier ones where the model allows)."""
        ids, attn = self._inputs(mb)
        kwargs = self._pixel_inputs(mb)
        if first_position > 0:
            if not self._head_on_suffix:
                out = self.module(
                    input_ids=ids, attention_mask=attn, use_cache=False, **kwargs
                ).logits
                return out[:, first_position:]
            kwargs["logits_to_keep"] = ids.shape[1] - first_position
        return self.module(input_ids=ids, attention_mask=attn, use_cache=False, **kwargs).logits

    def _pixel_inputs(self, mb: SeqBatch | None) -> dict[str, Any]:
        """A VLM's pixel inputs for `mb` (the dummy's blank image for an empty one)."""
        if self.vision is None:
            return {}
        if mb is None or mb.size == 0:
            return self.vision.dummy(self.ctx.device)[2]
        return self.vision.inputs(mb, self.ctx.device)

    def logprobs(
        self, mb: SeqBatch | None, *, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token log π (and entropy) under the rollout temperature, `[b, t]`, at the
        positions from one before the micro-batch's first `loss_mask` token on (0 before:
        nothing reads them). Prompts are most of a short-answer RL batch, and the head and
        log-softmax over a 49k vocabulary at every prompt position would be a fifth of the
        step's work, thrown away."""
        first = 0 if mb is None or mb.size == 0 else first_scored_position(mb.loss_mask)
        logits = self.logits(mb, first_position=first)
        ids, _ = self._inputs(mb)
        return token_logprobs(
            logits, ids, self.temperature, with_entropy=with_entropy, first_position=first
        )

    def values(self, mb: SeqBatch | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Critic: (values `[b, t]` with values[t] = V(state in which token t is chosen),
        i.e. the head's output at position t-1, 0 at t=0; bootstrap `[b]` = the output at
        the last real token, V of the state after the sequence)."""
        raw = self.logits(mb).squeeze(-1).float()
        values = torch.zeros_like(raw)
        values[:, 1:] = raw[:, :-1]
        if mb is None or mb.size == 0:
            return values, raw[:, -1]
        last = (mb.seq_lens.to(raw.device) - 1).clamp(min=0)
        bootstrap = raw.gather(1, last.unsqueeze(1)).squeeze(1)
        return values, bootstrap

    # -- optimisation ------------------------------------------------------------------------
    def zero_grad(self) -> None:
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)

    def clip_and_step(self) -> tuple[float, bool]:
        """Clip gradients to `gradient_clipping` (0: measure only) and step the optimizer
        unless the global grad norm is not finite. The schedule advances either way, so
        the learning rate stays a function of the step index. Returns (norm, stepped)."""
        assert self.optimizer is not None and self.scheduler is not None
        clip = self.cfg.optimizer.gradient_clipping if self.cfg.optimizer else 0.0
        params = [p for p in self.module.parameters() if p.grad is not None]
        max_norm = clip if clip and clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm, foreach=False)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        value = float(norm.item())
        stepped = math.isfinite(value)
        if stepped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._advance_schedule()
        return value, stepped

    def _advance_schedule(self) -> None:
        assert self.scheduler is not None
        with warnings.catch_warnings():
            # A skipped update still advances the schedule on purpose.
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
            self.scheduler.step()

    def skip_step(self) -> None:
        """Advance the schedule without an update (a minibatch with nothing to learn)."""
        assert self.optimizer is not None and self.scheduler is not None
        self.optimizer.zero_grad(set_to_none=True)
        self._advance_schedule()

    @property
    def lr(self) -> float:
        assert self.optimizer is not None
        return float(self.optimizer.param_groups[0]["lr"])

    # -- weights -----------------------------------------------------------------------------
    def full_state_dict(self, *, for_update: bool = False) -> dict[str, torch.Tensor]:
        """Unsharded parameters under the Hugging Face names (rank 0; {} elsewhere).
        Collective. With LoRA, the merged weights `W + (alpha / r) · B @ A`: what rollout
        serves and the HF export holds. `for_update`: what a weight update sends, i.e.
        without a frozen vision tower (the replicas keep the one they loaded)."""
        names = self.param_names
        if for_update and self.frozen_names:
            names = [n for n in names if n not in self.frozen_names]
        if not self.lora:
            return full_state_dict(self.module, names)
        sd = full_state_dict(self.module)
        if not sd:
            return sd
        merged = merge_lora(sd, self.lora)
        return {n: merged[n] for n in names}
