"""Which reward functions exist: built-in names, configured names, dotted paths.

A reward function is named by a short registered name (`gsm8k`) or by a dotted path
`package.module:function`. The service only resolves names here — it never imports user
code into its own process; the worker processes import the path (see `load_callable`).

Dotted paths arriving in requests are accepted only when they are registered (by name or
by path) unless `allow_dotted_paths` is on: a request must not be able to call an
arbitrary importable callable in the service's workers.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from services.core.plugins import load_dotted

__all__ = ["BUILTINS", "RewardRegistry", "ResolvedFn", "load_callable"]


BUILTINS: dict[str, str] = {
    "gsm8k": "services.reward.builtins:gsm8k_reward",
    "math": "services.reward.builtins:math_reward",
    "math_verify": "services.reward.builtins:math_reward",
    "exact_match": "services.reward.builtins:exact_match_reward",
    "geometry3k": "services.reward.builtins:geometry3k_reward",
    "clevr_count": "services.reward.builtins:clevr_count_reward",
    "format": "services.reward.builtins:format_reward",
    "arithmetic": "services.reward.builtins:arithmetic_reward",
}

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
DOTTED_PATH_RE = re.compile(rf"{_IDENT}(?:\.{_IDENT})*:{_IDENT}(?:\.{_IDENT})*")
# `pkg.module.fn` (no colon) is accepted too and read as `pkg.module:fn`.
_DOTTED_NO_COLON_RE = re.compile(rf"{_IDENT}(?:\.{_IDENT})+")
NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_\-]{0,63}")


class UnknownFunctionError(ValueError):
    """A function name or path the registry does not allow; the message lists the valid ones."""


@dataclass(frozen=True)
class ResolvedFn:
    name: str  # the label used in metrics and results: the registered name, else the path
    path: str  # "package.module:function"


def is_dotted_path(s: str) -> bool:
    return DOTTED_PATH_RE.fullmatch(s) is not None or _DOTTED_NO_COLON_RE.fullmatch(s) is not None


def canonical_path(s: str) -> str:
    """`pkg.module:fn` as is; `pkg.module.fn` → `pkg.module:fn`."""
    if ":" in s:
        return s
    module, _, attr = s.rpartition(".")
    return f"{module}:{attr}"


class RewardRegistry:
    """Names → dotted paths, with the service default and the dotted-path policy."""

    def __init__(
        self,
        functions: Mapping[str, str] | None = None,
        *,
        default: str = "gsm8k",
        allow_dotted_paths: bool = False,
    ) -> None:
        self._by_name: dict[str, str] = dict(BUILTINS)
        self.allow_dotted_paths = allow_dotted_paths
        for name, path in (functions or {}).items():
            self.register(name, path)
        self._by_path: dict[str, str] = {}
        self._reindex()
        self.default = self.resolve(default, _checking_default=True)

    def register(self, name: str, path: str) -> None:
        """Add a named function; a name taken twice is an error (no silent override)."""
        if not NAME_RE.fullmatch(name):
            raise ValueError(
                f"reward.functions: name {name!r} must be letters, digits, '_', '-' "
                "(at most 64 characters)"
            )
        if name in self._by_name:
            raise ValueError(
                f"reward.functions: {name!r} is already registered "
                f"(as {self._by_name[name]}); choose another name"
            )
        if not is_dotted_path(path):
            raise ValueError(
                f"reward.functions.{name}: {path!r} is not a dotted path; "
                "write it as 'package.module:function'"
            )
        self._by_name[name] = canonical_path(path)
        self._reindex()

    def _reindex(self) -> None:
        """Path → the first name registered for it (`math` before its alias `math_verify`)."""
        self._by_path = {}
        for name, path in self._by_name.items():
            self._by_path.setdefault(path, name)

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def paths(self) -> dict[str, str]:
        return dict(self._by_name)

    def resolve(self, fn: str, *, _checking_default: bool = False) -> ResolvedFn:
        """`""` → the default; a registered name → its path; a dotted path → itself when
        registered or allowed. Anything else raises `UnknownFunctionError`."""
        if not fn:
            if _checking_default:
                raise UnknownFunctionError("reward.fn: the default function must not be empty")
            return self.default
        if fn in self._by_name:
            return ResolvedFn(fn, self._by_name[fn])
        if is_dotted_path(fn):
            path = canonical_path(fn)
            if path in self._by_path:
                return ResolvedFn(self._by_path[path], path)
            if self.allow_dotted_paths or _checking_default:
                return ResolvedFn(path, path)
            raise UnknownFunctionError(
                f"fn {fn!r}: dotted paths in requests must be registered in "
                "reward.functions (or set reward.allow_dotted_paths=true); "
                f"registered: {', '.join(self.names())}"
            )
        raise UnknownFunctionError(
            f"fn {fn!r} is not a registered reward function; valid: {', '.join(self.names())} "
            "or a dotted path 'package.module:function'"
        )


def load_callable(path: str) -> Callable[..., Any]:
    """Import `package.module:attr[.attr]` and return the callable (worker side only), with
    `services.api.load_dotted`: a `DottedPathError` (`ValueError`) names what is missing."""
    if not is_dotted_path(path):
        raise ValueError(f"{path!r} is not a dotted path 'package.module:function'")
    fn: Callable[..., Any] = load_dotted(
        canonical_path(path), "reward function", require_callable=True
    )
    return fn
