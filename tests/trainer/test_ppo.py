"""The training step in one process (a one-rank FSDP2 group): what the step promises."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from services.trainer.optim import lr_factor
from services.trainer.ppo import PPOTrainer
from tests.trainer.helpers import synthetic_groups, trainer_config


@pytest.fixture(scope="module")
def groups(tiny_model_dir: Path):
    return synthetic_groups(tiny_model_dir, n_groups=3, seed=1)


def _trainer(tiny_model_dir: Path, tmp_path: Path, *overrides: str) -> PPOTrainer:
    return PPOTrainer(trainer_config(tiny_model_dir, tmp_path, *overrides))


@pytest.mark.parametrize("reuse", [True, False])
@pytest.mark.parametrize("decoupled", [True, False])
def test_one_minibatch_with_recompute_gives_importance_weight_exactly_one(
    tiny_model_dir: Path, tmp_path: Path, groups, decoupled: bool, reuse: bool
) -> None:
    t = _trainer(
        tiny_model_dir,
        tmp_path,
        "actor.ppo_n_minibatches=1",
        "actor.recompute_logprob=true",
        f"actor.use_decoupled_loss={str(decoupled).lower()}",
        "actor.prox_logp_method=recompute",
        "actor.mb_spec.n_mbs=2",
        f"trainer.reuse_first_minibatch_logp={str(reuse).lower()}",
    )
    for _ in range(2):  # the second step trains on data one version stale
        r = t.train_batch(groups)
        # π_θ and π_prox come from the same weights, the same micro-batches and the same
        # padding, so the ratio is exactly 1 (not merely close), and nothing is clipped.
        for red in ("avg", "min", "max"):  # AReaL's three reductions over the loss tokens
            assert r.stats[f"importance_weight/{red}"] == 1.0
            assert r.stats[f"approx_kl/{red}"] == 0.0
            assert r.stats[f"clip_ratio/{red}"] == 0.0
        # one per micro-batch (n_mbs=2), or none: the training forward is the recomputation
        assert r.prox_forwards == (0 if reuse else 2)
    if decoupled:
        # One version stale: π_prox (W_1) differs from π_behave (W_0).
        assert r.stats["behave_imp_weight/avg"] != 1.0


def test_loglinear_runs_no_proximal_forward(tiny_model_dir: Path, tmp_path: Path, groups) -> None:
    t = _trainer(
        tiny_model_dir,
        tmp_path,
        "actor.use_decoupled_loss=true",
        "actor.recompute_logprob=false",
        "actor.prox_logp_method=loglinear",
        "actor.ppo_n_minibatches=2",
    )
    kinds: list[str] = []
    t.on_forward(kinds.append)
    for _ in range(2):
        r = t.train_batch(groups)
        assert r.prox_forwards == 0
    assert "prox" not in kinds
    assert kinds.count("train") == 4  # 2 steps x 2 minibatches x 1 micro-batch
    assert "prox_alpha" in r.stats
    # A recompute trainer on the same data does run them.
    t2 = _trainer(
        tiny_model_dir,
        tmp_path,
        "actor.use_decoupled_loss=true",
        "actor.recompute_logprob=true",
        "actor.prox_logp_method=recompute",
        "actor.ppo_n_minibatches=2",
    )
    # one micro-batch per minibatch; the first minibatch reuses its training forward
    assert t2.train_batch(groups).prox_forwards == 1


def _weights(t: PPOTrainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in t.actor.full_state_dict().items()}


@pytest.mark.parametrize("n_minibatches", [1, 2])
def test_reusing_the_first_minibatch_logp_changes_nothing_but_the_forward_count(
    tiny_model_dir: Path, tmp_path: Path, groups, n_minibatches: int
) -> None:
    # Before the first optimizer step of a batch π_prox is π_θ: taking it from the training
    # forward instead of a separate pass must leave every number of two steps (the second
    # one a version stale, so behave != prox) as it was, within float summation noise.
    common = (
        f"actor.ppo_n_minibatches={n_minibatches}",
        "actor.use_decoupled_loss=true",
        "actor.recompute_logprob=true",
        "actor.prox_logp_method=recompute",
        "actor.mb_spec.n_mbs=2",
    )
    a = _trainer(tiny_model_dir, tmp_path, *common, "trainer.reuse_first_minibatch_logp=false")
    b = _trainer(tiny_model_dir, tmp_path, *common, "trainer.reuse_first_minibatch_logp=true")
    assert b.reuses_first_minibatch_logp and not a.reuses_first_minibatch_logp
    for _ in range(2):
        ra, rb = a.train_batch(groups), b.train_batch(groups)
        assert ra.prox_forwards == 2 * n_minibatches
        assert rb.prox_forwards == 2 * (n_minibatches - 1)
        torch.testing.assert_close(ra.loss, rb.loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ra.grad_norm, rb.grad_norm, rtol=1e-4, atol=1e-6)
        for key in ("importance_weight", "behave_imp_weight", "clip_ratio", "approx_kl"):
            for red in ("avg", "min", "max"):
                k = f"{key}/{red}"
                torch.testing.assert_close(ra.stats[k], rb.stats[k], rtol=1e-5, atol=1e-6)
    wa, wb = _weights(a), _weights(b)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-5)


def test_a_reference_model_keeps_the_full_proximal_pass(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    t = _trainer(
        tiny_model_dir,
        tmp_path,
        "actor.use_decoupled_loss=true",
        "actor.recompute_logprob=true",
        "actor.kl_ctl=0.1",
        f"ref.path={tiny_model_dir}",
    )
    assert not t.reuses_first_minibatch_logp  # the KL shaping needs π_old of every row


def test_micro_batching_does_not_change_the_update(
    tiny_model_dir: Path, tmp_path: Path, groups
) -> None:
    # The loss normaliser is the minibatch's token count, so 1 or 4 micro-batches give the
    # same gradient (up to float summation order).
    a = _trainer(tiny_model_dir, tmp_path, "actor.mb_spec.n_mbs=1")
    b = _trainer(tiny_model_dir, tmp_path, "actor.mb_spec.n_mbs=4")
    ra, rb = a.train_batch(groups), b.train_batch(groups)
    assert rb.phase_seconds  # ran
    assert b.forward_counts["train"] == 4
    torch.testing.assert_close(ra.loss, rb.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ra.grad_norm, rb.grad_norm, rtol=1e-4, atol=1e-6)
    wa, wb = _weights(a), _weights(b)
    # Adam's first step moves every weight by about lr * g / (|g| + eps): where |g| is
    # near eps, summation-order noise in g shows up as a small fraction of lr (1e-2).
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-4)


def test_non_finite_gradient_skips_the_update_and_counts_it(
    tiny_model_dir: Path, tmp_path: Path, groups
) -> None:
    t = _trainer(
        tiny_model_dir,
        tmp_path,
        "actor.optimizer.lr_scheduler_type=linear",
        "actor.optimizer.warmup_steps=2",
        "actor.use_decoupled_loss=true",
        "actor.recompute_logprob=true",
    )
    before = _weights(t)
    # A broken engine reports a finite but absurd behaviour logprob (-1e4, which the codec
    # accepts): the behaviour weight exp(log π_prox + 1e4) overflows and so does the gradient.
    bad = copy.deepcopy(groups)
    traj = bad[0].trajectories[0]
    traj.logprobs[traj.loss_mask.astype(bool).nonzero()[0][0]] = -1e4
    r = t.train_batch(bad)
    assert r.skipped_updates == 1
    assert not math.isfinite(r.grad_norm)
    after = _weights(t)
    for k in before:
        torch.testing.assert_close(before[k], after[k], rtol=0, atol=0)
    # The schedule still advanced: the next step uses warm-up factor (1 + 1) / 2 = 1.
    r2 = t.train_batch(groups)
    assert r2.skipped_updates == 0
    assert r2.lr == pytest.approx(
        1e-2 * lr_factor(1, total=100, warmup=2, kind="linear", min_lr_ratio=0.0)
    )
    assert r.lr == pytest.approx(1e-2 * 0.5)  # (0 + 1) / 2


def test_ppo_with_critic_and_reference(tiny_model_dir: Path, tmp_path: Path, groups) -> None:
    t = _trainer(
        tiny_model_dir,
        tmp_path,
        "actor.kl_ctl=0.1",
        "actor.recompute_logprob=true",  # π_old of the KL shaping = the current weights
        f"ref.path={tiny_model_dir}",
        "ref.dtype=float32",
        f"+critic.path={tiny_model_dir}",
        "critic.dtype=float32",
        "critic.optimizer.lr=1e-3",
        "critic.ppo_n_minibatches=2",
        "actor.gae_lambda=0.95",
        "actor.discount=0.99",
    )
    critic_before = {
        k: v.clone()
        for k, v in t.critic.full_state_dict().items()  # type: ignore[union-attr]
    }
    r1 = t.train_batch(groups)
    r2 = t.train_batch(groups)
    assert t.forward_counts["ref"] == 2  # one micro-batch per step
    # per step: the value pass walks the critic's plan (2 minibatches x 1 micro-batch),
    # then 2 training minibatches x 1 micro-batch: 4
    assert t.forward_counts["values"] == 2 * (2 + 2)
    # Step 1: π_old (behaviour logprobs of the initial weights) and π_ref are the same
    # policy, so the KL shaping is 0 up to float noise; after one update it is clearly not.
    assert abs(r1.stats["kl_rewards"]) < 1e-6
    assert r2.stats["kl_rewards"] < -1e-4
    assert r2.critic_loss is not None and math.isfinite(r2.critic_loss)
    # the critic's per-token statistics, AReaL's (areal/trainer/ppo/critic.py `ppo_loss_fn`)
    for name in ("value_clip_ratio", "critic_loss", "new_value", "target_value"):
        assert {f"{name}/avg", f"{name}/min", f"{name}/max"} <= set(r2.stats), name
    assert r2.stats["value_loss"] == r2.critic_loss
    critic_after = t.critic.full_state_dict()  # type: ignore[union-attr]
    assert any(not torch.equal(critic_before[k], critic_after[k]) for k in critic_before)


def test_kl_without_reference_is_a_clear_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = trainer_config(tiny_model_dir, tmp_path)
    cfg.actor.kl_ctl = 0.1  # bypasses the loader's own check on purpose
    with pytest.raises(ValueError, match="ref.path"):
        PPOTrainer(cfg)


def test_step_equals_a_plain_grpo_step(tiny_model_dir: Path, tmp_path: Path, groups) -> None:
    """The sharded step against GRPO written out by hand on the plain HF model.

    GRPO: A_i = (r_i - mean_g r) / (std_g r + eps) per prompt group (unbiased std), the same
    A_i on every generated token; on-policy the ratio is exp(logp - logp.detach()) = 1 with
    gradient ∇logp, so loss = -Σ_t A_t ratio_t / N over the N generated tokens; then the
    global-norm clip at 1.0 and one AdamW step. Weights must agree to float precision.
    """
    from transformers import AutoModelForCausalLM

    eps = 1e-5
    t = _trainer(
        tiny_model_dir,
        tmp_path,
        "actor.adv_norm=null",
        "+actor.reward_norm.mean_level=group",
        "actor.reward_norm.std_level=group",
        f"actor.reward_norm.eps={eps}",
        "actor.optimizer.lr=1e-3",
        "actor.optimizer.gradient_clipping=1.0",
        "actor.mb_spec.n_mbs=2",
    )
    r = t.train_batch(groups)
    got = t.actor.full_state_dict()

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0
    )
    terms, n_tokens = [], 0
    for g in groups:
        rewards = torch.tensor([tr.reward for tr in g.trajectories])
        adv = (rewards - rewards.mean()) / (rewards.std() + eps)
        for tr, a in zip(g.trajectories, adv, strict=True):
            ids = torch.as_tensor(tr.input_ids).unsqueeze(0)
            logits = model(input_ids=ids).logits[0, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None]).squeeze(1)
            mask = torch.as_tensor(tr.loss_mask[1:]).bool()
            terms.append(-(a * torch.exp(logp - logp.detach()))[mask].sum())
            n_tokens += int(mask.sum())
    loss = torch.stack(terms).sum() / n_tokens
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()

    torch.testing.assert_close(r.loss, float(loss), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(r.grad_norm, float(norm), rtol=1e-5, atol=1e-6)
    expected = dict(model.named_parameters())
    for k, v in got.items():
        torch.testing.assert_close(v, expected[k].detach(), rtol=0, atol=1e-5)


def test_teacher_log_probs_are_computed_like_the_reference(
    tiny_model_dir: Path, tmp_path: Path, groups
) -> None:
    # On-policy distillation (AReaL 2.0 `grpo_loss_fn` with teacher_logp from
    # `rl_trainer.py`): the teacher is the initial model, so at step 1 π_θ = π_teacher on
    # every token, the distillation term (log π_θ - log π_T) is exactly 0 and the loss
    # equals the loss without a teacher; after one update it is not.
    common = ("actor.recompute_logprob=true", "actor.use_decoupled_loss=false")
    t = _trainer(
        tiny_model_dir,
        tmp_path,
        *common,
        f"+teacher.path={tiny_model_dir}",
        "+teacher.dtype=float32",
        "+teacher.distill_loss_weight=1.0",
    )
    plain = _trainer(tiny_model_dir, tmp_path, *common)
    assert not t.reuses_first_minibatch_logp  # a teacher pass keeps the full proximal pass
    r1, p1 = t.train_batch(groups), plain.train_batch(groups)
    assert t.forward_counts["teacher"] == 1 and plain.forward_counts["teacher"] == 0
    assert r1.stats["rkl_loss/avg"] == 0.0 and r1.stats["rkl_loss/max"] == 0.0
    torch.testing.assert_close(r1.loss, p1.loss, rtol=0, atol=1e-7)
    r2 = t.train_batch(groups)
    assert t.forward_counts["teacher"] == 2
    assert r2.stats["rkl_loss/max"] > 0.0 and "teacher" in r2.phase_seconds


def test_step_reports_areal_token_counts(tiny_model_dir: Path, tmp_path: Path, groups) -> None:
    # AReaL 2.0 `ppo_actor_loss_fn` (areal/utils/functional/functional.py, cbff54d) counts
    # each packed micro-batch: n_total_tokens = its tokens (prompts included, no padding),
    # n_valid_tokens = its loss tokens, masked_token_ratio = 1 - V / N. Over the step the
    # counts add up to the batch's, whatever the micro-batch split and padding.
    trajs = [tr for g in groups for tr in g.trajectories]
    n_total = sum(tr.num_tokens for tr in trajs)
    n_valid = sum(int(tr.loss_mask.sum()) for tr in trajs)
    assert 0 < n_valid < n_total
    t = _trainer(tiny_model_dir, tmp_path, "actor.ppo_n_minibatches=2", "actor.mb_spec.n_mbs=2")
    r = t.train_batch(groups)
    assert r.stats["n_total_tokens"] == n_total == r.n_tokens
    assert r.stats["n_valid_tokens"] == n_valid
    assert r.stats["n_masked_tokens"] == n_total - n_valid
    assert r.stats["masked_token_ratio"] == pytest.approx(1 - n_valid / n_total, abs=1e-6)
