"""`${a.b.c}` interpolation: typed whole values, inside strings, defaults, env, errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import ConfigError, load_config, resolve_interpolations


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


BASE = "actor:\n  kl_ctl: 0.0\n"


def test_whole_value_keeps_its_type(tmp_path: Path) -> None:
    cfg = load_config(
        write(tmp_path, BASE + "  group_size: ${gconfig.n_samples}\ngconfig:\n  n_samples: 8\n")
    )
    assert cfg.actor.group_size == 8
    assert isinstance(cfg.actor.group_size, int)


def test_inside_a_string(tmp_path: Path) -> None:
    cfg = load_config(
        write(tmp_path, BASE + "seed: 7\ntrial_name: t${seed}-n${gconfig.n_samples}\n")
    )
    assert cfg.trial_name == "t7-n1"  # gconfig.n_samples comes from its default (1)


def test_target_missing_from_the_file_uses_the_schema_default(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, BASE + "  max_new_tokens: ${gconfig.max_new_tokens}\n"))
    assert cfg.actor.max_new_tokens == 16384  # AReaL's gconfig default


def test_override_propagates_through_references(tmp_path: Path) -> None:
    path = write(tmp_path, BASE + "  group_size: ${gconfig.n_samples}\ngconfig:\n  n_samples: 4\n")
    assert load_config(path, ["gconfig.n_samples=16"]).actor.group_size == 16


def test_chained_references(tmp_path: Path) -> None:
    text = BASE + "  group_size: ${actor.reward_norm.group_size}\n  reward_norm:\n"
    text += (
        "    mean_level: group\n    group_size: ${gconfig.n_samples}\ngconfig:\n  n_samples: 5\n"
    )
    cfg = load_config(write(tmp_path, text))
    assert cfg.actor.group_size == 5
    assert cfg.actor.reward_norm.group_size == 5


def test_whole_block_reference() -> None:
    raw = {"actor": {"path": "/m", "mb_spec": {"n_mbs": 3}}, "ref": {"mb_spec": "${actor.mb_spec}"}}
    assert resolve_interpolations(raw)["ref"]["mb_spec"] == {"n_mbs": 3}


def test_environment_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FW_TEST_ROOT", "/data/runs")
    monkeypatch.delenv("FW_TEST_UNSET", raising=False)
    text = BASE + "cluster:\n  fileroot: ${oc.env:FW_TEST_ROOT}\nseed: ${oc.env:FW_TEST_UNSET,11}\n"
    cfg = load_config(write(tmp_path, text))
    assert cfg.cluster.fileroot == "/data/runs"
    assert cfg.seed == 11


def test_unset_environment_variable_without_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FW_TEST_UNSET", raising=False)
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, BASE + "cluster:\n  fileroot: ${oc.env:FW_TEST_UNSET}\n"))
    assert info.value.paths == ["cluster.fileroot"]
    assert "FW_TEST_UNSET" in str(info.value)


def test_cycle_is_an_error(tmp_path: Path) -> None:
    text = (
        BASE
        + "  group_size: ${actor.ppo_n_minibatches}\n  ppo_n_minibatches: ${actor.group_size}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert "cycle" in str(info.value)


def test_missing_target_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, BASE + "  group_size: ${gconfig.n_sample}\n"))
    assert info.value.paths == ["actor.group_size"]
    assert "gconfig.n_sample" in str(info.value)


def test_reference_into_a_null_block_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, BASE + "  group_size: ${critic.ppo_n_minibatches}\n"))
    assert "is null" in str(info.value)


def test_block_inside_a_string_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, BASE + "trial_name: x-${gconfig}\n"))
    assert "block" in str(info.value)
