"""How a config names code: the dotted-path loader and small named registries.

Every config key that names code (`reward.fn`, `rollout.workflow`, `buffer.filter`,
`actor.surrogate`, ...) goes through `load_dotted`, whose errors name the key, the module
and the attribute, so a typo in a YAML file is reported in words a user can act on. A
`Registry` holds the built-in implementations of one extension point under short names: a
preset names its parts, an unknown name fails with the list of valid ones, registering a
name twice is an error instead of a silent override, and a name that contains a dot (or a
colon) and is not registered is imported with `load_dotted`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class DottedPathError(ValueError):
    """A dotted path that cannot be imported, or whose object does not fit its contract."""


def load_dotted(path: str, kind: str = "object", *, require_callable: bool = False) -> Any:
    """Import `package.module.attr` or `package.module:attr[.attr]` and return the object.

    `kind` names what is loaded, normally the config key (`"rollout.workflow"`), and starts
    every error message, so a typo in a YAML file is reported in words a user can act on:
    the module that cannot be imported (and why), or the attribute it lacks. Without a
    colon the last dot separates the module from the attribute; with one, everything after
    the colon is an attribute path (`pkg.mod:Class.method`). Any exception raised while
    the module is imported (a syntax error in user code, a missing dependency) is reported
    with its type; `require_callable` refuses an object that cannot be called.
    """
    if not isinstance(path, str) or not path.strip():
        raise DottedPathError(f"{kind}: expected a dotted path 'package.module.attr', got {path!r}")
    text = path.strip()
    if ":" in text:
        module_name, _, attr_path = text.partition(":")
    else:
        module_name, _, attr_path = text.rpartition(".")
    if not module_name or not attr_path:
        raise DottedPathError(f"{kind}: {path!r} is not a dotted path 'package.module.attr'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - user code may fail to import in any way
        raise DottedPathError(
            f"{kind}: cannot import module {module_name!r} of {path!r}: {type(exc).__name__}: {exc}"
        ) from exc
    owner = module_name
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise DottedPathError(f"{kind}: {owner!r} has no attribute {part!r}") from exc
        owner = f"{owner}.{part}"
    if require_callable and not callable(obj):
        raise DottedPathError(
            f"{kind}: {path!r} is a {type(obj).__name__}, not a callable (function or class)"
        )
    return obj


def accepts_positional(fn: Callable[..., Any], n: int) -> bool:
    """Whether `fn` can be called with `n` positional arguments (a structural check of a
    loaded function against a contract; objects without a signature pass)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    try:
        signature.bind(*([None] * n))
    except TypeError:
        return False
    return True


class RegistryError(DottedPathError):
    """A name is unknown, registered twice, or a dotted path cannot be imported (a
    `ValueError`, like every configuration error)."""


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
            try:
                obj = load_dotted(name, self.kind)
            except DottedPathError as exc:
                raise RegistryError(str(exc)) from exc
            if self._validate is not None and not self._validate(obj):
                raise RegistryError(f"{self.kind} {name!r}: {obj!r} does not fit the signature")
            return obj  # type: ignore[return-value]
        raise RegistryError(
            f"unknown {self.kind} {name!r}; valid: {', '.join(self.names())} "
            "(or a dotted path 'package.module.function')"
        )


__all__ = ["DottedPathError", "Registry", "RegistryError", "accepts_positional", "load_dotted"]
