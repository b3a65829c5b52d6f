"""Walking the config schema: the annotation below a key, the fields of a block.

Shared by the loader (unknown keys, defaults, typed overrides) and the AReaL translation
(which AReaL keys have a Flywheel field of the same name), so neither imports the other.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel

from .root import FlywheelConfig


def _unwrap(annotation: Any) -> Any:
    """The annotation with `None` removed from unions (Optional[X] -> X)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _unwrap(args[0])
        return annotation
    return annotation


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _is_dict(annotation: Any) -> bool:
    return annotation is dict or typing.get_origin(annotation) is dict


def _is_list(annotation: Any) -> bool:
    return annotation is list or typing.get_origin(annotation) in (list, tuple)


def _child(annotation: Any, key: str) -> Any:
    """Annotation of `key` below `annotation` (a model, dict or list annotation)."""
    ann = _unwrap(annotation)
    if _is_model(ann):
        field = ann.model_fields.get(key)
        return None if field is None else field.annotation
    if _is_dict(ann):
        args = typing.get_args(ann)
        return args[1] if len(args) == 2 else Any
    if _is_list(ann):
        args = typing.get_args(ann)
        return args[0] if args else Any
    return None


def flywheel_fields(dotted: str) -> set[str] | None:
    """Field names of the Flywheel block at `dotted` (`""` is the root, `actor.optimizer`
    a nested block); None when that path is not a block."""
    ann: Any = FlywheelConfig
    for part in [p for p in dotted.split(".") if p]:
        ann = _child(ann, part)
        if ann is None:
            return None
    cur = _unwrap(ann)
    return set(cur.model_fields) if _is_model(cur) else None
