"""Registries: one signature, unknown names list the valid ones, duplicates are errors."""

from __future__ import annotations

import pytest

from services.core.filters import FILTERS
from services.core.plugins import DottedPathError, Registry, RegistryError, load_dotted


def test_registry_rules() -> None:
    reg: Registry = Registry("widget", validate=callable)

    @reg.register("a")
    def a() -> int:
        return 1

    reg.add("b", lambda: 2)
    assert reg.get("a")() == 1 and reg.names() == ["a", "b"] and "a" in reg
    with pytest.raises(RegistryError, match="widget 'a' is already registered"):
        reg.add("a", lambda: 3)
    with pytest.raises(RegistryError, match=r"unknown widget 'c'; valid: a, b"):
        reg.get("c")
    with pytest.raises(RegistryError, match="does not fit the signature"):
        reg.add("x", 42)  # not callable
    reg.alias("legacy.path.a", "a")
    assert reg.get("legacy.path.a") is a
    reg.unregister("a")
    assert "legacy.path.a" not in reg and reg.names() == ["b"]
    # a dotted path is imported, and validated
    assert reg.get("math.sqrt")(9) == 3
    with pytest.raises(RegistryError, match="does not fit the signature"):
        reg.get("math.pi")


def test_load_dotted_errors() -> None:
    assert load_dotted("os.path:join")("a", "b") == "a/b"
    with pytest.raises(DottedPathError, match="cannot import module 'no_such_mod'"):
        load_dotted("no_such_mod.fn")
    with pytest.raises(DottedPathError, match="is not a dotted path"):
        load_dotted("plain")


def test_every_builtin_registry_is_populated() -> None:
    from services.trainer.algorithms import (
        AGGREGATORS,
        GAE_LAMBDA_FNS,
        KL_ESTIMATORS,
        SURROGATES,
    )

    assert SURROGATES.names() == ["cispo", "clip", "sapo"]
    assert KL_ESTIMATORS.names() == ["k1", "k2", "k3"]
    assert GAE_LAMBDA_FNS.names() == ["constant", "relative_position", "vapo_length_adaptive"]
    assert AGGREGATORS.names() == ["seq-mean-token-mean", "seq-mean-token-sum-norm", "token-mean"]
    assert FILTERS.names() == ["accept_all", "dapo_equal_rewards"]
