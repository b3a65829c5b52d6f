"""Reading files: YAML errors, unknown keys in the file, round trip of the resolved YAML."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from services.common.config import ConfigError, load_config, to_yaml


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "nope.yaml")
    assert "cannot read" in str(info.value)
    assert "nope.yaml" in str(info.value)


def test_yaml_syntax_error_names_the_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, "actor:\n  eps_clip: [0.2\n  kl_ctl: 0\n"))
    assert "line" in str(info.value)


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, "- a\n- b\n"))
    assert "mapping" in str(info.value)


def test_empty_file_means_defaults(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, ""), ["actor.kl_ctl=0"])
    assert cfg.actor.ppo_n_minibatches == 4


def test_unknown_key_in_the_file_names_the_nearest(tmp_path: Path) -> None:
    text = "actor:\n  kl_ctl: 0\n  adv_norm:\n    std_levl: null\n"
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    (issue,) = info.value.issues
    assert issue.path == "actor.adv_norm.std_levl"
    assert "did you mean 'actor.adv_norm.std_level'" in issue.message


def test_legacy_key_in_the_file_gets_the_migration(tmp_path: Path) -> None:
    text = "actor:\n  kl_ctl: 0\n  use_decoupled_loss: true\n  behave_imp_weight_cap: 5.0\n"
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    (issue,) = info.value.issues
    assert (issue.path, issue.value) == ("actor.behave_imp_weight_cap", 5.0)
    assert "rejection_sampling: {level: token, action: mask, metric: ratio, upper: 5.0}" in (
        issue.message
    )


def test_the_config_with_no_file_loads_and_has_no_kl_penalty() -> None:
    # Defaults are valid: kl_ctl defaults to 0 (see test_config_defaults DEVIATIONS).
    cfg = load_config(None)
    assert cfg.actor.kl_ctl == 0.0 and cfg.ref is None


def test_a_kl_penalty_without_ref_is_still_rejected() -> None:
    # An explicit kl_ctl > 0 with no reference model: AReaL would take the KL against
    # zeros (areal/trainer/ppo/actor.py, ref_logp = zeros_like); here it is an error.
    with pytest.raises(ConfigError) as info:
        load_config(None, ["actor.kl_ctl=0.1"])
    assert info.value.paths == ["actor.kl_ctl"]


def test_resolved_yaml_reloads_to_the_same_config(tmp_path: Path) -> None:
    grpo = Path(__file__).resolve().parents[3] / "examples" / "grpo.yaml"
    cfg = load_config(grpo, ["actor.adv_norm.std_level=null", "critic.value_loss=huber"])
    again = load_config(write(tmp_path, to_yaml(cfg, redact=False)))
    assert again == cfg


def test_auth_token_is_masked_in_printed_yaml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLYWHEEL_TOKEN", "s3cret")
    cfg = load_config(None, ["actor.kl_ctl=0"])
    assert cfg.services.auth_token == "s3cret"  # taken from the environment
    printed = to_yaml(cfg)
    assert "s3cret" not in printed
    assert yaml.safe_load(printed)["services"]["auth_token"] == "***"
    assert yaml.safe_load(to_yaml(cfg, redact=False))["services"]["auth_token"] == "s3cret"


def test_explicit_token_beats_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLYWHEEL_TOKEN", "from-env")
    cfg = load_config(None, ["actor.kl_ctl=0", "services.auth_token=given"])
    assert cfg.services.auth_token == "given"


def test_ports_default_to_zero_for_the_launcher_to_fill() -> None:
    cfg = load_config(None, ["actor.kl_ctl=0", "services.buffer.host=0.0.0.0"])
    assert cfg.services.buffer.host == "0.0.0.0"
    for name in ("rollout", "reward", "buffer", "trainer"):
        endpoint = getattr(cfg.services, name)
        assert (endpoint.port, endpoint.metrics_port) == (0, 0), name


def test_rollout_replica_addresses() -> None:
    cfg = load_config(
        None,
        [
            "actor.kl_ctl=0",
            "rollout.n_replicas=3",
            "services.rollout.port=50100",
            "services.rollout.metrics_port=9200",
        ],
    )
    # port 50100 + stride 1 * i
    assert [cfg.services.rollout.replica_address(i) for i in range(3)] == [
        "127.0.0.1:50100",
        "127.0.0.1:50101",
        "127.0.0.1:50102",
    ]
    assert cfg.services.rollout.replica_port(2, "metrics_port") == 9202
    assert cfg.services.rollout.replica_port(5) == 50105
    cfg = load_config(
        None,
        [
            "actor.kl_ctl=0",
            "services.rollout.port=50100",
            "services.rollout.metrics_port=9200",
            "services.rollout.port_stride=0",
            "services.rollout.host=fw-rollout-{i}.fw-rollout-headless",
        ],
    )
    assert cfg.services.rollout.replica_address(2) == "fw-rollout-2.fw-rollout-headless:50100"
    assert cfg.services.rollout.replica_port(2, "metrics_port") == 9200
    # an unassigned port stays 0 for every replica (the launcher picks them)
    cfg = load_config(None, ["actor.kl_ctl=0"])
    assert cfg.services.rollout.replica_port(3) == 0
