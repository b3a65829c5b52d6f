"""Every command-line override form, applied through `load_config` like the CLI does."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import ConfigError, apply_override, load_config, parse_value

GRPO = Path(__file__).resolve().parents[3] / "examples" / "grpo.yaml"


def load(*overrides: str):
    return load_config(GRPO, overrides)


def test_dotted_scalar_override() -> None:
    cfg = load("actor.eps_clip=0.3", "actor.rejection_sampling.upper=5")
    assert cfg.actor.eps_clip == 0.3
    assert cfg.actor.rejection_sampling is not None
    assert cfg.actor.rejection_sampling.upper == 5.0


def test_null_disables_a_normalisation_level() -> None:
    cfg = load("actor.adv_norm.std_level=null")
    assert cfg.actor.adv_norm is not None
    assert cfg.actor.adv_norm.std_level is None
    assert cfg.actor.adv_norm.mean_level == "batch"  # the rest of the block is kept


@pytest.mark.parametrize("word", ["none", "None", "NULL", "~"])
def test_none_words_mean_null_for_levels(word: str) -> None:
    assert load(f"actor.adv_norm.mean_level={word}").actor.adv_norm.mean_level is None


def test_whole_block_to_null() -> None:
    assert load("actor.reward_norm=null").actor.reward_norm is None


def test_key_below_a_null_block_creates_it_with_defaults() -> None:
    # grpo.yaml has no critic; setting one of its keys creates the block.
    cfg = load("critic.eps_clip=0.3", "critic.value_loss=huber")
    assert cfg.critic is not None
    assert cfg.critic.eps_clip == 0.3
    assert cfg.critic.value_loss == "huber"
    assert cfg.critic.ppo_n_minibatches == 4  # AReaL default for the rest


def test_plus_adds_a_key_missing_from_the_file() -> None:
    # grpo.yaml does not mention use_sapo_loss; AReaL users write `+` for such keys.
    cfg = load(
        "+actor.use_sapo_loss=true",
        "+actor.sapo_tau_pos=2.0",
        "actor.use_decoupled_loss=false",
        "actor.rejection_sampling=null",
        "actor.prox_logp_method=recompute",
    )
    assert cfg.actor.use_sapo_loss is True
    assert cfg.actor.sapo_tau_pos == 2.0


def test_plus_is_accepted_for_an_existing_key() -> None:
    assert load("+actor.eps_clip=0.25").actor.eps_clip == 0.25
    assert load("++actor.eps_clip=0.35").actor.eps_clip == 0.35


def test_plus_does_not_make_unknown_keys_valid() -> None:
    with pytest.raises(ConfigError) as info:
        load("+actor.eps_clipp=0.3")
    assert info.value.paths == ["actor.eps_clipp"]
    assert "actor.eps_clip" in str(info.value)


def test_tilde_resets_a_key_to_its_default() -> None:
    cfg = load("~actor.eps_clip")
    assert cfg.actor.eps_clip == 0.2  # AReaL default; grpo.yaml sets 0.4


def test_free_form_dict_fields_take_new_keys() -> None:
    cfg = load(
        "actor.gae_lambda=services.trainer.algorithms.gae.vapo_length_adaptive",
        "actor.gae_lambda_kwargs.alpha=0.05",
        "+actor.gae_lambda_kwargs.brand_new=abc",
        "rollout.workflow_kwargs.system_prompt=Be brief.",
    )
    assert cfg.actor.gae_lambda_kwargs == {"alpha": 0.05, "brand_new": "abc"}
    assert cfg.rollout.workflow_kwargs == {"system_prompt": "Be brief."}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("null", None),
        ("true", True),
        ("False", False),
        ("3", 3),
        ("0.5", 0.5),
        ("1e-5", 1e-5),  # plain YAML 1.1 would read this as a string
        ("-2E3", -2000.0),
        ("abc", "abc"),
        ("'3'", "3"),
        ("", ""),
        ("[1, 2]", [1, 2]),
        ("{a: 1, b: [x]}", {"a": 1, "b": ["x"]}),
    ],
)
def test_values_are_parsed_as_yaml(text: str, expected: object) -> None:
    assert parse_value(text) == expected
    assert type(parse_value(text)) is type(expected)


def test_exponent_float_reaches_the_model() -> None:
    assert load("actor.optimizer.lr=3e-6").actor.optimizer.lr == 3e-6


def test_list_and_dict_values() -> None:
    cfg = load("gconfig.stop=['\\n\\n', '####']", "scheduler.node_selector={gpu: h100}")
    assert cfg.gconfig.stop == ["\\n\\n", "####"]
    assert cfg.scheduler.node_selector == {"gpu": "h100"}


def test_list_index_override() -> None:
    cfg = load("gconfig.stop_token_ids=[5, 6, 7]", "gconfig.stop_token_ids.1=9")
    assert cfg.gconfig.stop_token_ids == [5, 9, 7]


def test_unknown_key_names_the_nearest_valid_key() -> None:
    with pytest.raises(ConfigError) as info:
        load("actor.eps_clp=0.3")
    (issue,) = info.value.issues
    assert issue.path == "actor.eps_clp"
    assert issue.value == "0.3"
    assert "did you mean 'actor.eps_clip'" in issue.message


def test_key_in_the_wrong_block_points_to_the_right_one() -> None:
    with pytest.raises(ConfigError) as info:
        load("actor.max_head_offpolicyness=4")
    assert "rollout.max_head_offpolicyness" in str(info.value)


def test_unknown_top_level_block() -> None:
    with pytest.raises(ConfigError) as info:
        load("rolout.engine=torch")
    assert "did you mean 'rollout'" in str(info.value)


def test_key_below_a_scalar_is_an_error() -> None:
    with pytest.raises(ConfigError) as info:
        load("actor.eps_clip.low=0.1")
    assert info.value.paths == ["actor.eps_clip"]
    assert "single value" in str(info.value)


def test_override_without_equals_sign() -> None:
    with pytest.raises(ConfigError) as info:
        load("actor.eps_clip")
    assert "no '='" in str(info.value)


def test_unparseable_value() -> None:
    with pytest.raises(ConfigError) as info:
        load("gconfig.stop=[a, b")
    assert info.value.paths == ["gconfig.stop"]
    assert "cannot parse" in str(info.value)


def test_bad_value_names_field_value_and_expectation() -> None:
    with pytest.raises(ConfigError) as info:
        load("actor.eps_clip=abc")
    (issue,) = info.value.issues
    assert (issue.path, issue.value) == ("actor.eps_clip", "abc")
    assert "valid number" in issue.message
    assert "PPO clip" in issue.message  # the field's own description is shown


def test_literal_value_lists_the_choices() -> None:
    with pytest.raises(ConfigError) as info:
        load("rollout.engine=vllm")
    (issue,) = info.value.issues
    assert issue.path == "rollout.engine"
    assert "'torch'" in issue.message and "'sglang'" in issue.message


def test_apply_override_mutates_only_the_target() -> None:
    raw: dict = {"actor": {"eps_clip": 0.2}}
    apply_override(raw, "actor.c_clip=3")
    assert raw == {"actor": {"eps_clip": 0.2, "c_clip": 3}}


def test_overrides_without_a_file() -> None:
    cfg = load_config(None, ["actor.kl_ctl=0", "seed=7"])
    assert cfg.seed == 7
    assert cfg.actor.eps_clip == 0.2
