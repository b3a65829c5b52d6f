"""Function registry (`services/reward/registry.py`): names, dotted paths, the policy."""

from __future__ import annotations

import pytest

from services.reward.builtins import gsm8k_reward
from services.reward.registry import (
    BUILTINS,
    RewardRegistry,
    UnknownFunctionError,
    canonical_path,
    load_callable,
)


def test_builtins_resolve_and_default() -> None:
    reg = RewardRegistry(default="gsm8k")
    assert reg.resolve("").name == "gsm8k"
    assert reg.resolve("math").path == "services.reward.builtins:math_reward"
    # The AReaL-style alias resolves to the same function, labelled by its first name.
    assert reg.resolve("math_verify").path == reg.resolve("math").path
    assert reg.resolve("services.reward.builtins:math_reward").name == "math"
    assert set(BUILTINS) <= set(reg.names())


def test_configured_functions_by_name_and_path() -> None:
    reg = RewardRegistry({"mine": "tests.reward.faulty.raises"}, default="mine")
    assert reg.default.path == "tests.reward.faulty:raises"  # `a.b.c` read as `a.b:c`
    assert reg.resolve("tests.reward.faulty:raises").name == "mine"


def test_unregistered_dotted_path_is_refused_unless_allowed() -> None:
    reg = RewardRegistry(default="gsm8k")
    with pytest.raises(UnknownFunctionError, match="must be registered"):
        reg.resolve("os:system")
    allowed = RewardRegistry(default="gsm8k", allow_dotted_paths=True)
    assert allowed.resolve("os:getcwd").path == "os:getcwd"


def test_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(UnknownFunctionError, match="valid: arithmetic, clevr_count"):
        RewardRegistry(default="gsm8k").resolve("gsm9k")


def test_duplicate_and_malformed_registrations_are_errors() -> None:
    with pytest.raises(ValueError, match="already registered"):
        RewardRegistry({"gsm8k": "pkg.mod:fn"})
    with pytest.raises(ValueError, match="not a dotted path"):
        RewardRegistry({"mine": "not a path"})
    with pytest.raises(ValueError, match="letters, digits"):
        RewardRegistry({"bad name": "pkg.mod:fn"})


def test_load_callable() -> None:
    assert load_callable("services.reward.builtins:gsm8k_reward") is gsm8k_reward
    assert load_callable("services.reward.builtins.gsm8k_reward") is gsm8k_reward
    assert canonical_path("a.b.c") == "a.b:c"
    with pytest.raises(ValueError, match="not a callable"):
        load_callable("services.reward.registry:BUILTINS")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        load_callable("no_such_module_xyz:fn")
