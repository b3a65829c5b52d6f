"""The actor config is the one gate (services/common/config/actor.py): what the trainer
cannot do fails at load, naming the value and the fix, and `actor.surrogate` is the one
surrogate setting, with AReaL's booleans translated to it."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import ConfigError, PPOActorConfig, load_config, to_yaml

GRPO = Path(__file__).resolve().parents[3] / "examples" / "grpo.yaml"
# grpo.yaml uses the decoupled loss, which SAPO excludes: these turn it off.
PLAIN = ("actor.rejection_sampling=null", "actor.use_decoupled_loss=false")


def only_issue(*overrides: str) -> tuple[str, object, str]:
    """(path, value, message) of the one error loading grpo.yaml with `overrides`."""
    with pytest.raises(ConfigError) as info:
        load_config(GRPO, overrides)
    (issue,) = info.value.issues
    return issue.path, issue.value, issue.message


@pytest.mark.parametrize("block", ["actor", "ref", "critic"])
def test_kk_packing_is_refused_at_load(block: str) -> None:
    extra = () if block == "actor" else (f"+{block}.path=x",)
    path, value, message = only_issue(*extra, f"{block}.mb_spec.packing_algorithm=kk")
    assert path == f"{block}.mb_spec.packing_algorithm" and value == "kk"
    assert "packing_algorithm: ffd" in message


def test_lora_loads_with_areals_names() -> None:
    # AReaL's gsm8k_grpo_lora.yaml spelling: peft_type lora, target_modules [all-linear].
    actor = load_config(
        GRPO,
        (
            "actor.use_lora=true",
            "actor.peft_type=lora",
            "actor.lora_rank=16",
            "actor.lora_alpha=16",
            "actor.target_modules=[all-linear]",
        ),
    ).actor
    assert (actor.use_lora, actor.lora_rank, actor.lora_alpha) == (True, 16, 16)
    assert actor.target_modules == ["all-linear"]
    listed = load_config(GRPO, ("actor.use_lora=true", "actor.target_modules=[q_proj,v_proj]"))
    assert listed.actor.target_modules == ["q_proj", "v_proj"]


@pytest.mark.parametrize(
    ("modules", "words"),
    [
        ("[all-linear,q_proj]", "give it alone"),
        ("['q proj']", "not a module name"),
        ("['']", "not a module name"),
    ],
)
def test_bad_target_modules_fail_at_load(modules: str, words: str) -> None:
    path, _value, message = only_issue("actor.use_lora=true", f"actor.target_modules={modules}")
    assert path == "actor.target_modules"
    assert words in message


@pytest.mark.parametrize(
    ("overrides", "surrogate", "sapo", "cispo"),
    [
        ((), "clip", False, False),
        ((*PLAIN, "actor.use_sapo_loss=true"), "sapo", True, False),
        ((*PLAIN, "actor.surrogate=sapo"), "sapo", True, False),
        ((*PLAIN, "actor.surrogate=sapo", "actor.use_sapo_loss=true"), "sapo", True, False),
        (
            (*PLAIN, "actor.use_cispo_loss=true", "actor.eps_clip_higher=4"),
            "cispo",
            False,
            True,
        ),
        ((*PLAIN, "actor.surrogate=cispo", "actor.eps_clip_higher=4"), "cispo", False, True),
        (("actor.surrogate=my_pkg.losses:soft_clip",), "my_pkg.losses:soft_clip", False, False),
    ],
)
def test_surrogate_and_the_areal_booleans_agree(
    overrides: tuple[str, ...], surrogate: str, sapo: bool, cispo: bool
) -> None:
    actor = load_config(GRPO, overrides).actor
    assert (actor.surrogate, actor.use_sapo_loss, actor.use_cispo_loss) == (surrogate, sapo, cispo)


def test_a_dump_of_the_resolved_config_loads_again(tmp_path: Path) -> None:
    cfg = load_config(GRPO, (*PLAIN, "actor.use_sapo_loss=true"))
    dumped = tmp_path / "resolved.yaml"
    dumped.write_text(to_yaml(cfg))
    again = load_config(dumped, ())
    assert again.actor.surrogate == "sapo" and again.actor.use_sapo_loss is True


@pytest.mark.parametrize(
    ("overrides", "path", "value", "words"),
    [
        (
            (*PLAIN, "actor.surrogate=clip", "actor.use_sapo_loss=true"),
            "actor.surrogate",
            "clip",
            "use_sapo_loss: true",
        ),
        (
            (*PLAIN, "actor.surrogate=sapo", "actor.use_cispo_loss=true"),
            "actor.surrogate",
            "sapo",
            "surrogate: cispo",
        ),
        (
            (*PLAIN, "actor.use_sapo_loss=true", "actor.use_cispo_loss=true"),
            "actor.use_cispo_loss",
            True,
            "at most one",
        ),
        (("actor.surrogate=softclip",), "actor.surrogate", "softclip", "clip, sapo, cispo"),
        # the rules of each surrogate hold whichever spelling chose it
        ((*PLAIN, "actor.surrogate=cispo"), "actor.eps_clip_higher", None, "eps_clip_higher"),
        (("actor.surrogate=sapo",), "actor.use_sapo_loss", True, "use_decoupled_loss: false"),
    ],
)
def test_conflicting_surrogate_settings_fail_at_load(
    overrides: tuple[str, ...], path: str, value: object, words: str
) -> None:
    got_path, got_value, message = only_issue(*overrides)
    assert (got_path, got_value) == (path, value)
    assert words in message


def test_built_in_code_too() -> None:
    assert PPOActorConfig(use_cispo_loss=True, eps_clip_higher=0.3).surrogate == "cispo"
    with pytest.raises(ValueError, match="contradicts use_sapo_loss"):
        PPOActorConfig(surrogate="cispo", use_sapo_loss=True, eps_clip_higher=0.3)
