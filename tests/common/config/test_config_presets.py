"""Every shipped preset in examples/ loads, validates and survives a round trip."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import FlywheelConfig, load_config, to_yaml

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
PRESETS = sorted(EXAMPLES.glob("*.yaml"))


def test_presets_exist() -> None:
    assert (EXAMPLES / "grpo.yaml") in PRESETS


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_preset_loads(preset: Path, tmp_path: Path) -> None:
    cfg = load_config(preset)
    assert isinstance(cfg, FlywheelConfig)
    again = tmp_path / preset.name
    again.write_text(to_yaml(cfg, redact=False))
    assert load_config(again) == cfg


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_preset_has_a_header_with_the_command(preset: Path) -> None:
    head = preset.read_text().split("\n\n", 1)[0]
    assert head.startswith("#"), f"{preset.name} must open with a comment saying what it is"
    assert "flywheel run --config examples/" in preset.read_text()


def test_grpo_is_grpo() -> None:
    cfg = load_config(EXAMPLES / "grpo.yaml")
    actor = cfg.actor
    assert cfg.critic is None
    assert actor.reward_norm is not None and actor.reward_norm.mean_level == "group"
    assert actor.group_size == cfg.gconfig.n_samples == 4
    assert actor.kl_ctl == 0.0 and cfg.ref is None
    assert actor.use_decoupled_loss and actor.decoupled_correction == "behave_imp_weight"
    assert cfg.rollout.max_head_offpolicyness == 2
    assert cfg.rollout.consumer_batch_size == cfg.train_dataset.batch_size
