"""The PPO-family training step on a batch of trajectory groups (`PPOTrainer.train_batch`).

One step, on every rank, from the same decoded batch:

1. plan: minibatches x ranks x micro-batches by token budget (`plan.py`);
2. forward-only passes over this rank's micro-batches, gathered into full-batch tensors:
   π_prox when the configured method needs a forward (`recompute`, `metrics`, or
   `recompute_logprob` without the decoupled loss), the reference log-probabilities when
   `kl_ctl > 0`, the teacher's when a `teacher` is configured (on-policy distillation),
   the critic's values for PPO with a critic;
3. advantages on the full batch (`algorithms.batch_advantages`: identical on every rank,
   no communication);
4. `ppo_n_minibatches` optimizer steps: forward with gradient under the rollout
   temperature, then `algorithms.actor_loss` (π_prox by the method — interpolated from
   π_θ for `loglinear`/`linear`, π_θ itself for `reuse_train_logp` — and the PPO-family
   loss with the minibatch-wide normaliser divided by the world size, as FSDP averages
   gradients over ranks), backward, clip, step — skipped and counted when the gradient
   norm is not finite;
5. the same for the critic with its own minibatches;
6. the version goes from v to v + 1.

No I/O and no buffer here: a single-process caller (tests, benchmarks, notebooks) drives
it with decoded `TrajectoryGroup`s; the service loop (`loop.py`) adds claiming, acks,
weight publication and checkpoints around it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from services.common.config import FlywheelConfig, OptimizerConfig
from services.common.config.views import ActorLossView, AdvantageView, CriticLossView
from services.core.types import TrajectoryGroup
from services.trainer.algorithms import (
    ACTOR_TOKEN_STATS,
    CRITIC_TOKEN_STATS,
    actor_loss,
    batch_advantages,
    critic_loss,
    needs_recompute,
)
from services.trainer.batch import SeqBatch, from_groups
from services.trainer.dist import DistContext, init_distributed
from services.trainer.engine import TrainEngine
from services.trainer.plan import Plan, make_plan, rank_microbatches
from services.trainer.stats_agg import StatAccumulator

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What one training step did; `stats` uses the algorithm core's statistic names."""

    version: int
    loss: float
    grad_norm: float
    lr: float
    stats: dict[str, float]
    n_seqs: int
    n_tokens: int
    skipped_updates: int
    prox_forwards: int
    minibatch_losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    staleness_per_seq: list[int] = field(default_factory=list)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    critic_loss: float | None = None


def schedule_steps(cfg: FlywheelConfig, n_minibatches: int) -> int:
    """Optimizer steps the lr schedule spans: (`trainer.lr_schedule_steps` or
    `total_train_steps`) x minibatches. Without either, a constant schedule without
    warm-up proportion still works; anything else needs the length."""
    steps = cfg.trainer.lr_schedule_steps or cfg.total_train_steps
    if steps is None:
        opt = cfg.actor.optimizer or OptimizerConfig()
        if opt.lr_scheduler_type != "constant" or (
            opt.warmup_steps is None and opt.warmup_steps_proportion > 0
        ):
            raise ValueError(
                f"actor.optimizer.lr_scheduler_type={opt.lr_scheduler_type!r} (or a warm-up "
                "proportion) needs the schedule length: set total_train_steps or "
                "trainer.lr_schedule_steps"
            )
        steps = 1_000_000
    return int(steps) * n_minibatches


class PPOTrainer:
    """Actor (+ critic, + reference) for one job; `train_batch` is one step.

    `ctx` defaults to a one-rank process group created here (single-process use).
    """

    def __init__(self, cfg: FlywheelConfig, ctx: DistContext | None = None) -> None:
        self.cfg = cfg
        self.ctx = ctx or init_distributed(cfg.trainer.device)
        actor = cfg.actor
        if actor.optimizer is None:
            log.warning("actor.optimizer is null; training with the default OptimizerConfig")
            actor = actor.model_copy(update={"optimizer": OptimizerConfig()})
        self.actor_cfg = actor
        # The algorithms' frozen settings, built once from the validated config.
        self.loss_view = ActorLossView.of(actor, cfg.teacher)
        self.advantage_view = AdvantageView.of(actor)
        self.critic_view = None if cfg.critic is None else CriticLossView.of(cfg.critic, actor)
        if abs(actor.temperature - cfg.gconfig.temperature) > 1e-9 and cfg.gconfig.temperature > 0:
            log.warning(
                "actor.temperature differs from gconfig.temperature; the trainer recomputes "
                "log-probabilities under actor.temperature",
                extra={"actor": actor.temperature, "gconfig": cfg.gconfig.temperature},
            )
        self.temperature = actor.temperature
        self.version = 0
        self.step = 0
        self.forward_counts = {"prox": 0, "ref": 0, "teacher": 0, "values": 0, "train": 0}
        torch.manual_seed(cfg.seed)
        self.actor = TrainEngine(
            actor,
            self.ctx,
            total_steps=schedule_steps(cfg, actor.ppo_n_minibatches),
            temperature=self.temperature,
        )
        self.critic: TrainEngine | None = None
        if cfg.critic is not None:
            if cfg.critic.optimizer is None:
                raise ValueError("critic.optimizer is null: a critic must be trained")
            self.critic = TrainEngine(
                cfg.critic,
                self.ctx,
                critic=True,
                total_steps=schedule_steps(cfg, cfg.critic.ppo_n_minibatches),
            )
        self.ref: TrainEngine | None = None
        if actor.kl_ctl > 0:
            if cfg.ref is None or not cfg.ref.path:
                raise ValueError(
                    f"actor.kl_ctl={actor.kl_ctl} needs a reference model: set ref.path "
                    "(usually the actor's initial checkpoint) or kl_ctl=0"
                )
            self.ref = TrainEngine(
                cfg.ref.model_copy(update={"optimizer": None}),
                self.ctx,
                temperature=self.temperature,
            )
        self.teacher: TrainEngine | None = None
        if cfg.teacher is not None:  # on-policy distillation, loaded like the reference
            # AReaL scores with the teacher engine's own config, temperature included.
            self.teacher = TrainEngine(
                cfg.teacher.model_copy(update={"optimizer": None}),
                self.ctx,
                temperature=cfg.teacher.temperature,
            )
        self._hooks: list[Callable[[str], None]] = []
        self.reuses_first_minibatch_logp = self._can_reuse_first_minibatch_logp()

    # -- introspection ---------------------------------------------------------------------
    def on_forward(self, hook: Callable[[str], None]) -> None:
        """Call `hook(kind)` on every forward pass ("prox", "ref", "teacher", "values",
        "train")."""
        self._hooks.append(hook)

    def _count(self, kind: str) -> None:
        self.forward_counts[kind] += 1
        for h in self._hooks:
            h(kind)

    @property
    def needs_prox_forward(self) -> bool:
        a = self.actor_cfg
        if a.use_decoupled_loss:
            return needs_recompute(a.prox_logp_method)
        return bool(a.recompute_logprob)

    def _can_reuse_first_minibatch_logp(self) -> bool:
        """Whether minibatch 0 takes π_prox from its own training forward (see
        `trainer.reuse_first_minibatch_logp`): only where that is the same number. Fixed by
        the configuration and the model, so decided once at construction."""
        if not (self.needs_prox_forward and self.cfg.trainer.reuse_first_minibatch_logp):
            return False
        if self.ref is not None or self.teacher is not None:
            return False
        hf = self.actor.hf_config
        dropouts = [
            float(getattr(hf, name, 0.0) or 0.0)
            for name in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop")
        ]
        modules = self.actor.module.modules()
        return not any(dropouts) and not any(
            isinstance(m, torch.nn.Dropout) and m.p > 0 for m in modules
        )

    # -- forward-only passes -----------------------------------------------------------------
    def _gather_rows(self, full: torch.Tensor) -> torch.Tensor:
        """Every rank filled its own rows (zeros elsewhere): summing gives the full tensor."""
        if self.ctx.world_size > 1:
            buf = full.to(self.ctx.device)
            dist.all_reduce(buf)
            return buf.cpu()
        return full

    @torch.no_grad()
    def _forward_pass(
        self, engine: TrainEngine, batch: SeqBatch, plan: Plan, kind: str
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        shape = batch.input_ids.shape
        out = torch.zeros(shape, dtype=torch.float32)
        boot = torch.zeros(batch.size, dtype=torch.float32) if kind == "values" else None
        for _, rows in rank_microbatches(plan, self.ctx.rank):
            mb = batch.select(rows) if rows else None
            self._count(kind)
            if kind == "values":
                vals, b = engine.values(mb)
                if rows:
                    out[rows, : vals.shape[1]] = vals.float().cpu()
                    assert boot is not None
                    boot[rows] = b.float().cpu()
            else:
                logp, _ = engine.logprobs(mb)
                if rows:
                    out[rows, : logp.shape[1]] = logp.float().cpu()
        out = self._gather_rows(out)
        if boot is not None:
            boot = self._gather_rows(boot)
        return out, boot

    # -- the step ------------------------------------------------------------------------------
    def train_batch(self, groups: Sequence[TrajectoryGroup]) -> StepResult:
        """One training step on `groups` (collective: every rank passes the same groups)."""
        t_step = time.perf_counter()
        phases: dict[str, float] = {}
        cfg, actor_cfg = self.cfg, self.actor_cfg
        v = self.version
        batch = from_groups(
            groups, pad_id=int(getattr(self.actor.hf_config, "pad_token_id", 0) or 0)
        )
        lens = batch.seq_lens.tolist()
        world = self.ctx.world_size
        plan = make_plan(
            lens,
            n_minibatches=actor_cfg.ppo_n_minibatches,
            world_size=world,
            mb_spec=actor_cfg.mb_spec,
        )
        loss_mask = batch.loss_mask.bool()

        prox_full: torch.Tensor | None = None
        prox_forwards_before = self.forward_counts["prox"]
        reuse_first = self.reuses_first_minibatch_logp
        prox_plan = plan[1:] if reuse_first else plan
        if self.needs_prox_forward and prox_plan:
            t = time.perf_counter()
            self.actor.module.eval()
            prox_full, _ = self._forward_pass(self.actor, batch, prox_plan, "prox")
            self.actor.module.train()
            phases["prox"] = time.perf_counter() - t
        ref_full = None
        if self.ref is not None:
            t = time.perf_counter()
            ref_full, _ = self._forward_pass(self.ref, batch, plan, "ref")
            phases["ref"] = time.perf_counter() - t
        teacher_full = None
        if self.teacher is not None:
            t = time.perf_counter()
            teacher_full, _ = self._forward_pass(self.teacher, batch, plan, "teacher")
            phases["teacher"] = time.perf_counter() - t
        values_full = boot_full = None
        critic_plan: Plan | None = None
        if self.critic is not None:
            t = time.perf_counter()
            assert cfg.critic is not None
            critic_plan = make_plan(
                lens,
                n_minibatches=cfg.critic.ppo_n_minibatches,
                world_size=world,
                mb_spec=cfg.critic.mb_spec,
            )
            self.critic.module.eval()
            values_full, boot_full = self._forward_pass(self.critic, batch, critic_plan, "values")
            self.critic.module.train()
            phases["values"] = time.perf_counter() - t

        t = time.perf_counter()
        adv = batch_advantages(
            self.advantage_view,
            batch,
            prox_logprobs=prox_full,
            ref_logprobs=ref_full,
            values=values_full,
            bootstrap_values=boot_full,
        )
        phases["advantages"] = time.perf_counter() - t
        train_mask = adv.loss_mask.bool()

        t = time.perf_counter()
        actor_out = self._train_actor(
            batch,
            plan,
            adv.advantages,
            train_mask,
            prox_full,
            v,
            reuse_first=reuse_first,
            teacher_full=teacher_full,
        )
        phases["train"] = time.perf_counter() - t
        critic_loss_value = None
        critic_stats: dict[str, float] = {}
        if self.critic is not None:
            t = time.perf_counter()
            assert critic_plan is not None and values_full is not None
            critic_loss_value, critic_stats = self._train_critic(
                batch, critic_plan, values_full, adv.returns, train_mask
            )
            phases["critic_train"] = time.perf_counter() - t

        stats = {k: float(x) for k, x in adv.stats.items()}
        stats.update(actor_out["stats"])
        stats.update(critic_stats)
        gen = loss_mask & (batch.versions >= 0)
        oldest = torch.where(gen, batch.versions, torch.iinfo(torch.int64).max).min(dim=1).values
        staleness = [
            int(v - o) for o, g in zip(oldest.tolist(), gen.any(1).tolist(), strict=True) if g
        ]
        self.version = v + 1
        self.step += 1
        norms = actor_out["grad_norms"]
        return StepResult(
            version=self.version,
            loss=sum(actor_out["losses"]) / max(1, len(actor_out["losses"])),
            grad_norm=sum(norms) / len(norms) if norms else 0.0,
            lr=actor_out["lr"],
            stats=stats,
            n_seqs=batch.size,
            n_tokens=batch.n_tokens,
            skipped_updates=actor_out["skipped"],
            prox_forwards=self.forward_counts["prox"] - prox_forwards_before,
            minibatch_losses=actor_out["losses"],
            grad_norms=norms,
            staleness_per_seq=staleness,
            phase_seconds={**phases, "step": time.perf_counter() - t_step},
            critic_loss=critic_loss_value,
        )

    def _normalizer(self, rows: list[int], mask: torch.Tensor, mode: str) -> float:
        """The minibatch-wide denominator of `aggregate_loss`, divided by the world size
        because FSDP averages gradients over ranks (see aggregation.py)."""
        if not rows:
            return 0.0
        m = mask[rows]
        count = float(m.sum()) if mode == "token-mean" else float(m.any(dim=1).sum())
        return count / self.ctx.world_size

    def _train_actor(
        self,
        batch: SeqBatch,
        plan: Plan,
        advantages: torch.Tensor,
        train_mask: torch.Tensor,
        prox_full: torch.Tensor | None,
        v: int,
        *,
        reuse_first: bool = False,
        teacher_full: torch.Tensor | None = None,
    ) -> dict[str, Any]:
        a = self.actor_cfg
        engine = self.actor
        dev = self.ctx.device
        acc = StatAccumulator()
        losses: list[float] = []
        norms: list[float] = []
        skipped = 0
        lr = engine.lr
        n_mini = len(plan)
        for m, per_rank in enumerate(plan):
            mini_rows = sorted(r for mbs in per_rank for mb in mbs for r in mb)
            normalizer = self._normalizer(mini_rows, train_mask, a.loss_agg_mode)
            lr = engine.lr
            if normalizer <= 0:
                engine.skip_step()
                losses.append(0.0)
                continue
            loss_sum = 0.0
            for rows in per_rank[self.ctx.rank]:
                mb = batch.select(rows) if rows else None
                self._count("train")
                logp, entropy = engine.logprobs(mb, with_entropy=True)
                if mb is None:
                    (logp.sum() * 0.0).backward()
                    continue
                width = logp.shape[1]
                mask = train_mask[rows, :width].to(dev)
                behave = mb.behave_logp.to(dev)
                versions = mb.versions.to(dev)
                if m == 0 and reuse_first:  # no step taken yet: π_prox is this π_θ
                    recomputed: torch.Tensor | None = logp.detach()
                else:
                    recomputed = None if prox_full is None else prox_full[rows, :width].to(dev)
                teacher = None if teacher_full is None else teacher_full[rows, :width].to(dev)
                loss, stats = actor_loss(
                    self.loss_view,
                    logp,
                    advantages[rows, :width].to(dev),
                    mask,
                    behave_logprobs=behave,
                    recomputed_logprobs=recomputed,
                    versions=versions,
                    current_version=v,
                    theta_version=v + m / n_mini,
                    teacher_logprobs=teacher,
                    normalizer=normalizer,
                    entropy=None if entropy is None else entropy.detach(),
                    attention_mask=mb.attention_mask[:, :width].to(dev),
                )
                loss.backward()
                loss_sum += float(loss.detach())
                acc.add_loss_stats(stats, ACTOR_TOKEN_STATS)
            norm, stepped = engine.clip_and_step()
            norms.append(norm)
            if not stepped:
                skipped += 1
                log.warning("non-finite grad norm: update skipped", extra={"minibatch": m})
            total = torch.tensor([loss_sum], dtype=torch.float64)
            if self.ctx.world_size > 1:
                dist.all_reduce(total)
            losses.append(float(total.item()) / self.ctx.world_size)
        step_stats = acc.reduce()
        step_stats["actor_loss"] = sum(losses) / max(1, len(losses))
        return {
            "stats": step_stats,
            "losses": losses,
            "grad_norms": norms,
            "skipped": skipped,
            "lr": lr,
        }

    def _train_critic(
        self,
        batch: SeqBatch,
        plan: Plan,
        old_values: torch.Tensor,
        returns: torch.Tensor,
        train_mask: torch.Tensor,
    ) -> tuple[float, dict[str, float]]:
        """Critic minibatches → (mean loss, the critic's statistics: AReaL's per-token
        ones from `CRITIC_TOKEN_STATS`)."""
        assert self.critic is not None and self.cfg.critic is not None
        engine, critic_view = self.critic, self.critic_view
        assert critic_view is not None
        dev = self.ctx.device
        acc = StatAccumulator()
        losses = []
        for per_rank in plan:
            mini_rows = sorted(r for mbs in per_rank for mb in mbs for r in mb)
            normalizer = self._normalizer(mini_rows, train_mask, self.actor_cfg.loss_agg_mode)
            if normalizer <= 0:
                engine.skip_step()
                continue
            loss_sum = 0.0
            for rows in per_rank[self.ctx.rank]:
                mb = batch.select(rows) if rows else None
                self._count("values")
                values, _ = engine.values(mb)
                if mb is None:
                    (values.sum() * 0.0).backward()
                    continue
                width = values.shape[1]
                loss, cstats = critic_loss(
                    values,
                    old_values[rows, :width].to(dev),
                    returns[rows, :width].to(dev),
                    train_mask[rows, :width].to(dev),
                    critic_view,
                    normalizer=normalizer,
                )
                loss.backward()
                loss_sum += float(loss.detach())
                acc.add_loss_stats(cstats, CRITIC_TOKEN_STATS)
            engine.clip_and_step()
            total = torch.tensor([loss_sum], dtype=torch.float64)
            if self.ctx.world_size > 1:
                dist.all_reduce(total)
            losses.append(float(total.item()) / self.ctx.world_size)
        stats = acc.reduce()
        stats.pop("n_valid_tokens", None)  # the actor's count is the step's
        mean_loss = sum(losses) / max(1, len(losses))
        stats["value_loss"] = mean_loss
        return mean_loss, stats

    # -- state -----------------------------------------------------------------------------------
    def checkpoint_models(self) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer | None]]:
        models = {"actor": (self.actor.module, self.actor.optimizer)}
        if self.critic is not None:
            models["critic"] = (self.critic.module, self.critic.optimizer)
        return models

    def scheduler_states(self) -> dict[str, Any]:
        from services.trainer.optim import scheduler_state

        out = {"actor": scheduler_state(self.actor.scheduler)}  # type: ignore[arg-type]
        if self.critic is not None:
            out["critic"] = scheduler_state(self.critic.scheduler)  # type: ignore[arg-type]
        return out

    def load_scheduler_states(self, states: dict[str, Any]) -> None:
        from services.trainer.optim import load_scheduler_state

        load_scheduler_state(self.actor.scheduler, states["actor"])  # type: ignore[arg-type]
        if self.critic is not None and "critic" in states:
            load_scheduler_state(self.critic.scheduler, states["critic"])  # type: ignore[arg-type]
