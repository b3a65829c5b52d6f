"""`${a.b.c}` and `${oc.env:NAME[,default]}` in a config tree, resolved as OmegaConf does.

Resolved after the overrides and before validation, so an override changes every reference
to the key it sets; a reference to a key the file does not set takes the schema's default.
"""

from __future__ import annotations

import os
import re
from typing import Any

from pydantic import BaseModel

from .errors import ConfigError, ConfigIssue
from .overrides import parse_value
from .root import FlywheelConfig
from .schema import _child, _is_model, _unwrap

_INTERP = re.compile(r"\$\{([^${}]+)\}")


def resolve_interpolations(raw: dict[str, Any]) -> dict[str, Any]:
    """Replace `${a.b.c}` by the value at that path (the schema default when the file
    does not set it) and `${oc.env:NAME[,default]}` by an environment variable.

    A string that is exactly one `${...}` takes the referenced value with its type
    (`group_size: ${gconfig.n_samples}` is an int); inside longer strings the value is
    formatted in (`name: run-${seed}`). Cycles are an error.
    """
    return _Resolver(raw).resolve(raw, ())


class _Resolver:
    def __init__(self, root: dict[str, Any]):
        self.root = root
        self.active: list[str] = []

    def resolve(self, node: Any, where: tuple[str, ...]) -> Any:
        if isinstance(node, dict):
            return {k: self.resolve(v, (*where, str(k))) for k, v in node.items()}
        if isinstance(node, list):
            return [self.resolve(v, (*where, str(i))) for i, v in enumerate(node)]
        if isinstance(node, str) and "${" in node:
            return self._string(node, where)
        return node

    def _string(self, text: str, where: tuple[str, ...]) -> Any:
        whole = _INTERP.fullmatch(text.strip())
        if whole:
            return self._lookup(whole.group(1).strip(), where)

        def substitute(match: re.Match[str]) -> str:
            value = self._lookup(match.group(1).strip(), where)
            if isinstance(value, dict | list):
                raise ConfigError(
                    ConfigIssue(
                        ".".join(where),
                        text,
                        f"${{{match.group(1)}}} is a block and cannot be placed inside a string",
                    )
                )
            return (
                "null"
                if value is None
                else str(value).lower()
                if isinstance(value, bool)
                else str(value)
            )

        return _INTERP.sub(substitute, text)

    def _lookup(self, ref: str, where: tuple[str, ...]) -> Any:
        here = ".".join(where)
        if ref.startswith(("oc.env:", "env:")):
            name, _, default = ref.split(":", 1)[1].partition(",")
            value = os.environ.get(name.strip())
            if value is None:
                if not default:
                    raise ConfigError(
                        ConfigIssue(
                            here,
                            f"${{{ref}}}",
                            f"environment variable {name.strip()} is not set; set it or give a default: ${{oc.env:{name.strip()},value}}",
                        )
                    )
                value = default.strip()
            return parse_value(value)
        if ref in self.active:
            chain = " -> ".join([*self.active, ref])
            raise ConfigError(ConfigIssue(here, f"${{{ref}}}", f"interpolation cycle: {chain}"))
        self.active.append(ref)
        try:
            found = self._find(ref, here)
            return self.resolve(found, tuple(ref.split(".")))
        finally:
            self.active.pop()

    def _find(self, ref: str, here: str) -> Any:
        parts = ref.split(".")
        node: Any = self.root
        ann: Any = FlywheelConfig
        for depth, part in enumerate(parts):
            path = ".".join(parts[: depth + 1])
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            elif (
                isinstance(node, dict)
                and _is_model(_unwrap(ann))
                and part in _unwrap(ann).model_fields
            ):
                default = _unwrap(ann).model_fields[part].get_default(call_default_factory=True)
                node = default.model_dump() if isinstance(default, BaseModel) else default
            else:
                why = "is null" if node is None else "does not exist"
                raise ConfigError(
                    ConfigIssue(
                        here, f"${{{ref}}}", f"interpolation target '{path}' {why}; check the path"
                    )
                )
            ann = _child(ann, part) if ann is not None else None
        return node
