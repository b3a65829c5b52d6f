"""Small named registries with one signature each, and the dotted-path loader.

Every pluggable piece of the algorithm core (surrogates, KL estimators, GAE λ functions,
loss aggregation modes, dynamic filters) lives in a `Registry`: a preset names its parts,
an unknown name fails with the list of valid ones, and registering a name twice is an
error instead of a silent override. A name that contains a dot and is not registered is
treated as `package.module.attribute` and imported (with `services.api.load_dotted`, the one
loader every config key uses), so users plug in their own function from a config file
without touching Flywheel.

This module imports nothing heavy (no torch): `filters` builds on it and the buffer
service imports `filters` without paying for torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from services.api import DottedPathError
from services.api import load_dotted as _load_dotted

T = TypeVar("T")


class RegistryError(DottedPathError):
    """A name is unknown, registered twice, or a dotted path cannot be imported (a
    `ValueError`, like every configuration error)."""


def load_dotted(path: str, *, what: str = "object") -> object:
    """`services.api.load_dotted` with this module's error type (`RegistryError`); kept so
    existing callers and plugins that import it from here keep working."""
    try:
        return _load_dotted(path, what)
    except DottedPathError as exc:
        raise RegistryError(str(exc)) from exc


class Registry(Generic[T]):
    """Name → implementation, with a documented kind used in every error message.

    `get` accepts a registered name, an alias (e.g. AReaL's dotted path of the same
    built-in), or a dotted path to import. Objects loaded by dotted path are checked with
    `validate` when one is given (e.g. "is callable").
    """

    def __init__(self, kind: str, *, validate: Callable[[object], bool] | None = None) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        self._aliases: dict[str, str] = {}
        self._validate = validate

    def add(self, name: str, item: T) -> T:
        """Register `item` under `name` and return it."""
        if not isinstance(name, str) or not name:
            raise RegistryError(f"{self.kind}: a name must be a non-empty string, got {name!r}")
        if name in self._items or name in self._aliases:
            raise RegistryError(
                f"{self.kind} {name!r} is already registered; choose another name "
                f"(registered: {', '.join(self.names())})"
            )
        if self._validate is not None and not self._validate(item):
            raise RegistryError(f"{self.kind} {name!r}: {item!r} does not fit the signature")
        self._items[name] = item
        return item

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of `add`: `@registry.register("name")`."""

        def _decorator(item: T) -> T:
            return self.add(name, item)

        return _decorator

    def alias(self, alias: str, name: str) -> None:
        """Let `alias` (e.g. an AReaL dotted path) resolve to the registered `name`."""
        if name not in self._items:
            raise RegistryError(f"{self.kind}: cannot alias {alias!r} to unknown {name!r}")
        if alias in self._items or alias in self._aliases:
            raise RegistryError(f"{self.kind}: alias {alias!r} is already taken")
        self._aliases[alias] = name

    def unregister(self, name: str) -> None:
        """Remove a name (tests and plugins that register temporary entries)."""
        if name not in self._items:
            raise RegistryError(f"{self.kind} {name!r} is not registered")
        del self._items[name]
        for alias in [a for a, n in self._aliases.items() if n == name]:
            del self._aliases[alias]

    def names(self) -> list[str]:
        """Registered names, sorted (aliases are not listed)."""
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items or name in self._aliases

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def get(self, name: str) -> T:
        """Resolve a name, alias or dotted path; unknown names list the valid ones."""
        if not isinstance(name, str):
            raise RegistryError(f"{self.kind}: expected a name, got {name!r}")
        if name in self._items:
            return self._items[name]
        if name in self._aliases:
            return self._items[self._aliases[name]]
        if "." in name or ":" in name:
            obj = load_dotted(name, what=self.kind)
            if self._validate is not None and not self._validate(obj):
                raise RegistryError(f"{self.kind} {name!r}: {obj!r} does not fit the signature")
            return obj  # type: ignore[return-value]
        raise RegistryError(
            f"unknown {self.kind} {name!r}; valid: {', '.join(self.names())} "
            "(or a dotted path 'package.module.function')"
        )
