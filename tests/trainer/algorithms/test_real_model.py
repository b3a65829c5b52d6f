"""The algorithm core driven by a real tiny Hugging Face model and a real loaded config.

Checks the invariants that only hold end to end: with one minibatch and a recomputed
π_prox the importance weight is exactly 1 (the recompute and the training forward are
the same weights on the same tokens), the config views accept the shipped GRPO preset,
and one optimizer step on the loss moves the policy in the direction of the advantages.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.config import PPOActorConfig, load_config
from services.common.config.views import ActorLossView, AdvantageView
from services.common.tiny_model import write_tiny_model
from services.trainer.algorithms import compute_advantages, compute_prox_logp, ppo_actor_loss
from services.trainer.algorithms.stats import (
    ACTOR_TOKEN_STATS,
    check_stat_names,
    summarize_token_stats,
)

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(
        tmp_path_factory.mktemp("tiny") / "model", hidden_size=32, num_layers=1, num_heads=2
    )


def _token_logprobs(model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """log π(token_t | tokens_<t), aligned to tokens (position 0 gets 0)."""
    logits = model(input_ids=ids, attention_mask=attn).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1)


def _batch(gen: torch.Generator) -> dict[str, torch.Tensor]:
    b, t, prompt = 8, 12, 4
    ids = torch.randint(3, 24, (b, t), generator=gen)
    lengths = torch.randint(prompt + 2, t + 1, (b,), generator=gen)
    pos = torch.arange(t).unsqueeze(0)
    attn = (pos < lengths.unsqueeze(1)).long()
    loss_mask = (pos >= prompt) & attn.bool()
    versions = torch.where(loss_mask, torch.randint(1, 3, (b, t), generator=gen), -1)
    return {
        "ids": ids,
        "attn": attn,
        "loss_mask": loss_mask,
        "versions": versions,
        "rewards": torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0]),
        "no_eos": lengths == t,
        "group_ids": torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]),
    }


def test_one_minibatch_with_recompute_gives_importance_weight_exactly_one(
    tiny_model_dir: Path, gen: torch.Generator
) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    cfg = load_config(
        EXAMPLES / "grpo.yaml", ["actor.ppo_n_minibatches=1", "actor.prox_logp_method=recompute"]
    )
    data = _batch(gen)

    # "Rollout": the behaviour policy is the same weights seen through a noisy engine.
    with torch.no_grad():
        model.eval()
        recomputed = _token_logprobs(model, data["ids"], data["attn"])
    behave = recomputed + 0.05 * torch.randn(recomputed.shape, generator=gen)

    adv = compute_advantages(
        AdvantageView.of(cfg.actor),
        rewards=data["rewards"],
        loss_mask=data["loss_mask"],
        no_eos=data["no_eos"],
        logprobs=recomputed,
        group_ids=data["group_ids"],
        attention_mask=data["attn"],
    )
    check_stat_names(adv.stats)
    prox = compute_prox_logp(
        cfg.actor.prox_logp_method, theta_logprobs=recomputed, recomputed_logprobs=recomputed
    ).prox_logprobs

    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    logp = _token_logprobs(model, data["ids"], data["attn"])
    settings = ActorLossView.of(cfg.actor)
    loss, stats = ppo_actor_loss(
        logp,
        prox,
        adv.advantages,
        adv.loss_mask,
        settings,
        behave_logprobs=behave,
        versions=data["versions"],
        current_version=2,
    )
    check_stat_names(stats)
    # same weights, same tokens: bitwise-equal log-probabilities, ratio exactly 1
    assert torch.equal(logp.detach()[adv.loss_mask], prox[adv.loss_mask])
    reported = summarize_token_stats(stats, ACTOR_TOKEN_STATS)
    assert reported["importance_weight/avg"].item() == 1.0
    assert reported["importance_weight/min"].item() == 1.0
    assert reported["clip_ratio/avg"].item() == 0.0
    loss.backward()
    opt.step()
    opt.zero_grad()

    # After the step the policy moved: a second minibatch would see a ratio != 1, and the
    # tokens with positive advantage gained probability on average.
    new_logp = _token_logprobs(model, data["ids"], data["attn"]).detach()
    plain = ActorLossView.of(PPOActorConfig())
    _, after = ppo_actor_loss(new_logp, prox, adv.advantages, adv.loss_mask, plain)
    assert summarize_token_stats(after, ACTOR_TOKEN_STATS)["importance_weight/avg"].item() != 1.0
    moved = (new_logp - prox)[adv.loss_mask]
    a = adv.advantages[adv.loss_mask]
    assert (moved * a).sum() > 0


def test_reuse_train_logp_is_exact_with_one_minibatch(
    tiny_model_dir: Path, gen: torch.Generator
) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    data = _batch(gen)
    logp = _token_logprobs(model, data["ids"], data["attn"])
    prox = compute_prox_logp("reuse_train_logp", theta_logprobs=logp, ppo_n_minibatches=1)
    _, stats = ppo_actor_loss(
        logp,
        prox.prox_logprobs,
        torch.ones_like(logp),
        data["loss_mask"],
        ActorLossView.of(PPOActorConfig()),
    )
    assert summarize_token_stats(stats, ACTOR_TOKEN_STATS)["importance_weight/max"].item() == 1.0
