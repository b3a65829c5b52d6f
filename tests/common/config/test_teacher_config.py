"""The `teacher` block of on-policy distillation: AReaL 2.0's names and defaults
(`TeacherConfig` in areal/api/cli_args.py), its nested `train:` form, and what Flywheel
refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from services.common.config import ConfigError, FlywheelConfig, TeacherConfig, load_config


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


@pytest.mark.parametrize("key", ["behave_imp_weight_cap", "behave_imp_weight_mode"])
@pytest.mark.parametrize("nested", [False, True])
def test_the_removed_weight_cap_gets_the_actors_migration_message(
    key: str, nested: bool, tmp_path: Path
) -> None:
    # AReaL refuses behave_imp_weight_cap/_mode wherever a PPOActorConfig is read, the
    # teacher's `train:` block included; the message is the actor's migration to
    # rejection_sampling, not a "did you mean" to an unrelated teacher key.
    block = {"path": "/ckpt/teacher", key: 5}
    teacher = {"train": block} if nested else block
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"teacher": teacher}))
    with pytest.raises(ConfigError) as info:
        # The nested form is read as Flywheel's (TeacherConfig's `train:` nesting); detected
        # as AReaL's it goes through the translation instead.
        load_config(str(path), source="flywheel" if nested else "auto")
    (issue,) = info.value.issues
    assert issue.path == ("teacher.train." if nested else "teacher.") + key
    assert "did you mean" not in issue.message
    assert "rejection_sampling: {level: token, action: mask, metric: ratio, upper: 5.0}" in (
        issue.message
    )
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"+actor.{key}=5"])
    assert info.value.issues[0].message == issue.message  # the same text as the actor's
