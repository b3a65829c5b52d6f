"""The `teacher` block of on-policy distillation: AReaL 2.0's names and defaults
(`TeacherConfig` in areal/api/cli_args.py), its nested `train:` form, and what Flywheel
refuses."""

from __future__ import annotations

import pytest

from services.common.config import FlywheelConfig, TeacherConfig, load_config


def test_defaults_are_areals() -> None:
    # AReaL 2.0 TeacherConfig: path "", offload False, rl_loss_weight 1.0,
    # distill_loss_weight 0.005. engine_type: AReaL "rollout" (an inference server), here
    # "train" (the trainer scores the teacher like `ref`): a documented difference.
    t = TeacherConfig()
    assert (t.path, t.offload, t.rl_loss_weight, t.distill_loss_weight) == ("", False, 1.0, 0.005)
    assert t.engine_type == "train"
    assert FlywheelConfig().teacher is None  # no teacher term unless configured


def test_areal_nested_train_block_is_read() -> None:
    # AReaL's legacy train-engine teacher: `teacher: {engine_type: train, train: {...}}`;
    # the train block is a PPOActorConfig whose loss fields mean nothing for a teacher.
    t = TeacherConfig.model_validate(
        {
            "engine_type": "train",
            "train": {"path": "/ckpt/teacher", "dtype": "bf16", "ppo_n_minibatches": 4},
            "distill_loss_weight": 0.01,
        }
    )
    assert (t.path, t.dtype, t.distill_loss_weight) == ("/ckpt/teacher", "bfloat16", 0.01)
    # AReaL: teacher.path, when set, overrides
    t = TeacherConfig.model_validate({"path": "/top", "train": {"path": "/nested"}})
    assert t.path == "/top"


def test_rollout_teacher_and_useless_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="engine_type: train"):
        TeacherConfig.model_validate({"engine_type": "rollout", "rollout": {}})
    with pytest.raises(ValueError, match="the loss is 0"):
        TeacherConfig(rl_loss_weight=0.0, distill_loss_weight=0.0)
    with pytest.raises(ValueError, match="never trained"):
        TeacherConfig.model_validate({"optimizer": {"lr": 1e-5}})


def test_root_block_loads_from_overrides() -> None:
    cfg = load_config(
        None,
        [
            "+teacher.path=/ckpt/teacher",
            "+teacher.rl_loss_weight=0",
            "+teacher.distill_loss_weight=1.0",
            "actor.kl_ctl=0",
        ],
    )
    assert cfg.teacher is not None and cfg.teacher.rl_loss_weight == 0.0
    assert cfg.teacher.path == "/ckpt/teacher"


def test_a_teacher_without_a_checkpoint_is_refused_when_the_actor_has_one() -> None:
    with pytest.raises(ValueError, match="teacher.path"):
        load_config(None, ["actor.path=/ckpt/actor", "+teacher.dtype=float32", "actor.kl_ctl=0"])
