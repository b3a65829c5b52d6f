"""LoRA training (services/trainer/lora.py and its hooks in the engine and checkpoints).

The reference is the LoRA paper (Hu et al. 2021, eq. 3: h = W0 x + (alpha / r) B A x,
with B = 0 at the start) and PEFT's conventions that AReaL relies on
(areal/engine/fsdp_engine.py `_apply_peft_wrapper`: `all-linear` for an empty
`target_modules`, scaling alpha / r). Real tiny Qwen2 model, real FSDP2 (a 1-rank mesh, and
2 ranks over gloo), a real rollout replica for the weight push.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from services.common.config import FlywheelConfig
from services.common.redis_server import free_port
from services.trainer import checkpoint as ckpt
from services.trainer.batch import SeqBatch
from services.trainer.engine import TrainEngine
from services.trainer.io_loop import IOLoop
from services.trainer.lora import LoRALinear, apply_lora, is_adapter, merge_lora, select_targets
from services.trainer.model import full_state_dict, parameter_names
from services.trainer.ppo import PPOTrainer
from services.trainer.weight_sync import WeightPublisher, version_dir
from tests.trainer.helpers import synthetic_groups, trainer_config

RANK, ALPHA = 4, 8  # scale alpha / r = 2: neither alpha nor r / alpha
LORA = ("actor.use_lora=true", f"actor.lora_rank={RANK}", f"actor.lora_alpha={ALPHA}")


def _hf(model_dir: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _batch(ids: list[int]) -> SeqBatch:
    """One unpadded row (the helper of the weight-sync tests)."""
    from tests.trainer.test_weight_sync import _as_batch

    return _as_batch(torch.tensor([ids]))


IDS = [5, 9, 14, 3, 7, 11, 20, 4]


# --------------------------------------------------------------------------- the layer


def test_layer_and_merge_follow_the_lora_formula_on_a_worked_case() -> None:
    # W = [[1,0,0],[0,1,0]], b = 0, A = [[1,2,3]] (r = 1), B = [[1],[0.5]], alpha = 2:
    # scale = alpha / r = 2. For x = [1,1,1]: W x = [1,1]; A x = 6; B (A x) = [6,3];
    # h = [1,1] + 2 * [6,3] = [13,7]. Merged W' = W + 2 B A
    #   = [[1,0,0],[0,1,0]] + 2 * [[1,2,3],[0.5,1,1.5]] = [[3,4,6],[1,3,3]], and W' x = [13,7].
    base = nn.Linear(3, 2, bias=True)
    with torch.no_grad():
        base.weight.copy_(torch.tensor([[1.0, 0, 0], [0, 1, 0]]))
        base.bias.zero_()
    layer = LoRALinear(base, rank=1, alpha=2, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        layer.lora_A.copy_(torch.tensor([[1.0, 2, 3]]))
        layer.lora_B.copy_(torch.tensor([[1.0], [0.5]]))
    x = torch.ones(1, 3)
    torch.testing.assert_close(layer(x), torch.tensor([[13.0, 7.0]]), rtol=0, atol=0)
    sd = {f"l.{k}": v for k, v in layer.state_dict().items()}
    merged = merge_lora(sd, {"l": layer.scaling})
    assert set(merged) == {"l.weight", "l.bias"}
    expected = torch.tensor([[3.0, 4, 6], [1, 3, 3]])
    torch.testing.assert_close(merged["l.weight"], expected, rtol=0, atol=0)
    # The base layer's own parameters are reused (no copy) and frozen.
    assert layer.weight is base.weight and not layer.weight.requires_grad


def test_targets_all_linear_skips_the_head_and_names_are_suffixes(tiny_model_dir: Path) -> None:
    model = _hf(tiny_model_dir)
    linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    # PEFT's all-linear: every nn.Linear but the output head (lm_head).
    assert "lm_head" in linear
    assert select_targets(model, []) == [n for n in linear if n != "lm_head"]
    assert select_targets(model, ["all-linear"]) == select_targets(model, [])
    assert select_targets(model, ["q_proj", "self_attn.v_proj"]) == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.v_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.v_proj",
    ]
    with pytest.raises(ValueError, match=r"\['qkv'\] match no module.*q_proj"):
        select_targets(model, ["q_proj", "qkv"])
    with pytest.raises(ValueError, match="not a linear layer"):
        select_targets(model, ["mlp"])


# --------------------------------------------------------------------------- the engine


def test_first_forward_equals_the_base_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    # B starts at zero: the adapted model is the base model, to the bit.
    plain = _hf(tiny_model_dir)
    adapted = copy.deepcopy(plain)
    apply_lora(adapted, rank=RANK, alpha=ALPHA, target_modules=[])
    ids = torch.tensor([IDS])
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids).logits, plain(ids).logits, rtol=0, atol=0)
    # The same through the sharded engine (1-rank FSDP2 mesh), against it without LoRA.
    cfg = trainer_config(tiny_model_dir, tmp_path, *LORA).actor
    ctx = _ctx()
    with_lora = TrainEngine(cfg, ctx, total_steps=4)
    without = TrainEngine(cfg.model_copy(update={"use_lora": False}), ctx, total_steps=4)
    assert with_lora.lora and not without.lora
    with torch.no_grad():
        a, b = with_lora.logits(_batch(IDS)), without.logits(_batch(IDS))
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def _ctx():
    from services.trainer.dist import init_distributed

    return init_distributed("cpu")


def test_only_adapters_get_gradients_and_the_optimizer(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = trainer_config(tiny_model_dir, tmp_path, *LORA).actor
    engine = TrainEngine(cfg, _ctx(), total_steps=4)
    assert engine.optimizer is not None
    named = dict(engine.module.named_parameters())
    adapters = {n for n in named if is_adapter(n)}
    # 2 layers x 7 linear layers (q, k, v, o, gate, up, down) x (A, B).
    assert len(adapters) == 2 * 7 * 2
    in_optim = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    assert in_optim == {id(named[n]) for n in adapters}
    before = {n: p.detach().full_tensor().clone() for n, p in named.items()}
    logits = engine.logits(_batch(IDS))
    # Any scalar of the logits gives every adapter a gradient once B is non-zero; at B = 0,
    # dL/dA = 0 (A's gradient goes through B) and dL/dB = scale * dL/dh (A x)^T != 0.
    logits.float().pow(2).mean().backward()
    with_grad = {n for n, p in named.items() if p.grad is not None}
    assert with_grad == adapters
    for n in adapters:
        if n.endswith("lora_A"):
            assert named[n].grad.full_tensor().abs().max() == 0, n  # B = 0
        else:
            assert named[n].grad.full_tensor().abs().max() > 0, n
    engine.clip_and_step()
    after = {n: p.detach().full_tensor() for n, p in named.items()}
    for n in named:
        if n.endswith("lora_B"):
            assert not torch.equal(after[n], before[n]), f"{n} did not move"
        elif not is_adapter(n):
            assert torch.equal(after[n], before[n]), f"frozen {n} moved"


def test_a_lora_critic_trains_its_new_value_head_too(tiny_model_dir: Path, tmp_path: Path) -> None:
    # The value head starts from a fresh initialisation: frozen, the critic could not learn
    # values at all (PEFT's token-classification task keeps it trainable the same way).
    cfg = trainer_config(tiny_model_dir, tmp_path, *LORA).actor
    critic = TrainEngine(cfg, _ctx(), critic=True, total_steps=4)
    trained = {n for n, p in critic.module.named_parameters() if p.requires_grad}
    assert {n for n in trained if not is_adapter(n)} == {"score.weight", "score.bias"}
    assert "score" not in critic.lora  # the head itself gets no adapter


def test_gradient_checkpointing_gives_the_same_lora_step(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # AReaL's gsm8k_grpo_lora.yaml turns gradient checkpointing on: with a frozen base and
    # frozen embeddings, recomputation must still reach the adapters.
    groups = synthetic_groups(tiny_model_dir, n_groups=2, seed=1)
    results = []
    for gc in ("false", "true"):
        cfg = trainer_config(tiny_model_dir, tmp_path, *LORA, f"actor.gradient_checkpointing={gc}")
        trainer = PPOTrainer(cfg)
        r = trainer.train_batch(groups)
        results.append((r.loss, r.grad_norm, trainer.actor.full_state_dict()))
    (loss0, norm0, w0), (loss1, norm1, w1) = results
    assert norm0 > 0
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(norm1, norm0, rtol=1e-5, atol=1e-7)
    for n in w0:
        torch.testing.assert_close(w1[n], w0[n], rtol=0, atol=1e-6)


def test_merged_state_dict_is_w_plus_scaled_ba_under_the_base_names(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    trainer = PPOTrainer(trainer_config(tiny_model_dir, tmp_path, *LORA))
    trainer.train_batch(synthetic_groups(tiny_model_dir, n_groups=2, seed=1))
    trainer.train_batch(synthetic_groups(tiny_model_dir, n_groups=2, seed=2))
    raw = full_state_dict(trainer.actor.module)  # base weights and adapters
    merged = trainer.actor.full_state_dict()
    base = _hf(tiny_model_dir)
    names = parameter_names(base)
    assert list(merged) == names
    shapes = dict(base.named_parameters())
    assert {n: tuple(t.shape) for n, t in merged.items()} == {
        n: tuple(shapes[n].shape) for n in names
    }
    layers = {n[: -len(".lora_A")] for n in raw if n.endswith(".lora_A")}
    assert len(layers) == 14
    for layer in layers:
        # By hand in float64: W + (alpha / r) * B @ A. The merge runs in float32 with one
        # rounding of the product and one of the sum, ~1e-7 relative on |W| ~ 0.1.
        w = raw[f"{layer}.weight"].double()
        b, a = raw[f"{layer}.lora_B"].double(), raw[f"{layer}.lora_A"].double()
        expected = w + (ALPHA / RANK) * (b @ a)
        assert (expected - w).abs().max() > 1e-4, f"{layer}: the adapter did not move"
        torch.testing.assert_close(merged[f"{layer}.weight"].double(), expected, rtol=0, atol=1e-6)
    for n in names:
        if n.rsplit(".", 1)[0] not in layers:  # norms, embeddings, biases: the base's own
            torch.testing.assert_close(merged[n], shapes[n].detach(), rtol=0, atol=0)


def test_checkpoint_resume_restores_base_and_adapters(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = trainer_config(tiny_model_dir, tmp_path, *LORA, "actor.ppo_n_minibatches=2")
    groups_a = synthetic_groups(tiny_model_dir, n_groups=2, seed=3)
    groups_b = synthetic_groups(tiny_model_dir, n_groups=2, seed=4)
    t1 = PPOTrainer(cfg)
    t1.train_batch(groups_a)
    torch.manual_seed(123)
    random.seed(5)
    np.random.seed(6)
    path = ckpt.save_checkpoint(
        tmp_path / "ckpt",
        t1.step,
        models=t1.checkpoint_models(),
        trainer_state={"version": t1.version, "schedulers": t1.scheduler_states()},
        rank=0,
    )
    import torch.distributed.checkpoint as dcp

    saved = set(dcp.FileSystemReader(str(path / "dcp")).read_metadata().state_dict_metadata)
    assert "actor.model.model.layers.0.self_attn.q_proj.lora_A" in saved
    assert "actor.model.model.layers.0.self_attn.q_proj.weight" in saved  # the frozen base
    r1 = t1.train_batch(groups_b)

    t2 = PPOTrainer(cfg)
    state = ckpt.load_checkpoint(path, models=t2.checkpoint_models(), rank=0)
    t2.load_scheduler_states(state["schedulers"])
    r2 = t2.train_batch(groups_b)
    assert r2.minibatch_losses == r1.minibatch_losses
    w1, w2 = full_state_dict(t1.actor.module), full_state_dict(t2.actor.module)
    assert set(w1) == set(w2) and any(is_adapter(n) for n in w1)
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], rtol=0, atol=0)

    # A resume without LoRA would silently drop the adapters: refused, naming the fix.
    plain = PPOTrainer(trainer_config(tiny_model_dir, tmp_path, "actor.ppo_n_minibatches=2"))
    with pytest.raises(ValueError, match="LoRA adapters differ.*use_lora"):
        ckpt.load_checkpoint(path, models=plain.checkpoint_models(), rank=0)

    # The HF export is the merged model: transformers loads it and computes what the
    # adapted trainer computes.
    out = ckpt.export_hf(t2.actor.full_state_dict(), tiny_model_dir, tmp_path / "hf")
    exported = _hf(out)
    with torch.no_grad():
        got = exported(torch.tensor([IDS])).logits
        want = t2.actor.logits(_batch(IDS))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- publication


@pytest.mark.integration
def test_disk_push_leaves_the_replica_on_the_merged_weights(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from services.core.types import SamplingParams
    from services.rollout.client import RolloutClient
    from services.trainer.logprobs import token_logprobs
    from tests.trainer.services import running_replica

    cfg: FlywheelConfig = trainer_config(
        tiny_model_dir,
        tmp_path,
        *LORA,
        f"services.rollout.port={free_port()}",
        f"services.rollout.metrics_port={free_port()}",
        "trainer.weight_transport=disk",
        "rollout.weight_update_timeout=60",
        f"trainer.weight_dir={tmp_path / 'weights'}",  # the replica's weights root
    )
    trainer = PPOTrainer(cfg)
    trainer.train_batch(synthetic_groups(tiny_model_dir, n_groups=2, seed=1))
    merged = trainer.actor.full_state_dict()
    io = IOLoop("test-lora")
    try:
        with running_replica(cfg, tmp_path) as address:

            async def push_and_sample():
                pub = WeightPublisher(cfg, weight_dir=tmp_path / "weights", addresses=[address])
                try:
                    report = await pub.publish(merged, 1)
                finally:
                    await pub.close()
                async with RolloutClient(address) as c:
                    sampling = SamplingParams(n_samples=2, max_new_tokens=10, seed=7)
                    return report, await c.generate(prompt_ids=[IDS[:4]], sampling=sampling)

            report, result = io.run(push_and_sample(), timeout=180)
    finally:
        io.close()
    assert report.failed == {} and report.updated == [address]
    # What went over the wire: plain HF names, the merged tensors, nothing else.
    files = sorted(version_dir(tmp_path / "weights", 1).glob("*.safetensors"))
    on_disk: dict[str, torch.Tensor] = {}
    for f in files:
        on_disk.update(load_file(str(f)))
    assert set(on_disk) == set(merged) and not any(is_adapter(n) for n in on_disk)
    for n, t in merged.items():
        torch.testing.assert_close(on_disk[n], t, rtol=0, atol=0)
    # The replica serves them: its log-probabilities are the adapted trainer's, and not the
    # base model's (the step moved them).
    base = _hf(tiny_model_dir)
    moved = 0.0
    for comp in result.completions:
        assert list(comp.versions) == [1] * len(comp.output_ids)
        ids = torch.tensor([[*IDS[:4], *comp.output_ids]])
        with torch.no_grad():
            lp, _ = token_logprobs(trainer.actor.logits(_batch(ids[0].tolist())), ids, 1.0)
            base_lp, _ = token_logprobs(base(ids).logits, ids, 1.0)
        served = torch.tensor(comp.logprobs, dtype=torch.float32)
        torch.testing.assert_close(served, lp[0, 4:].float(), rtol=1e-4, atol=1e-4)
        moved = max(moved, float((served - base_lp[0, 4:]).abs().max()))
    assert moved > 1e-3


# --------------------------------------------------------------------------- FSDP2 ranks


@pytest.mark.integration
@pytest.mark.slow
def test_two_gloo_ranks_equal_one_rank_on_a_lora_step(tiny_model_dir: Path, tmp_path: Path) -> None:
    from tests.trainer.test_fsdp_equivalence import _batches, _check, _in_process, _run

    batches = _batches(tmp_path, tiny_model_dir)
    overrides = (
        *LORA,
        "actor.target_modules=[q_proj,v_proj]",
        "actor.ppo_n_minibatches=2",
        "actor.mb_spec.max_tokens_per_mb=40",
    )
    two = _run(2, tmp_path, tiny_model_dir, batches, "cpu", *overrides)
    one = _in_process(tmp_path, tiny_model_dir, batches, *overrides)
    _check(one, two)  # losses, grad norms and the merged weights agree
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    weights = one[1]
    q = "model.layers.0.self_attn.q_proj.weight"
    assert (weights[q] - initial[q]).abs().max() > 1e-3  # q_proj carries an adapter
    k = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(weights[k], initial[k])  # k_proj has none: frozen
