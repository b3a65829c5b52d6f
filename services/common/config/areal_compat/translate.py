"""Translate a resolved AReaL tree into Flywheel's: the rules in order, then every AReaL
key no rule handled, reported as ignored."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from ..schema import flywheel_fields
from .fields import AREAL_FIELDS, blocks
from .report import Translation
from .rules_agent import agent
from .rules_bookkeeping import checkpoints, evaluation, names, tracking
from .rules_placement import allocations, launcher, lora, scheduler, sglang, weight_update
from .rules_training import sft, small_keys, teacher
from .tree import TreeEditor


def leftovers(t: TreeEditor) -> None:
    """Every other AReaL-only key: accepted and reported as ignored (runs last, so that it
    sees which keys the rules handled)."""
    handled = {row.key for row in t.rows}
    for path, areal_names in AREAL_FIELDS.items():
        for node_path, node in blocks(t.out, path):
            known = flywheel_fields(node_path)
            if known is None:
                continue
            for key in [k for k in node if k in areal_names and k not in known]:
                dotted = f"{node_path}.{key}" if node_path else key
                if dotted not in handled:
                    t.drop(dotted)


RULES: tuple[Callable[[TreeEditor], None], ...] = (
    allocations,
    weight_update,
    lora,
    names,
    checkpoints,
    evaluation,
    tracking,
    sglang,
    scheduler,
    launcher,
    small_keys,
    agent,
    sft,
    teacher,
    leftovers,
)
"""The rules in the order they run: later ones read what earlier ones set (`sglang` reads
`rollout.engine` from `allocations`; `leftovers` reports what no rule handled)."""


def translate(tree: dict[str, Any]) -> tuple[dict[str, Any], list[Translation]]:
    """The Flywheel tree for the resolved AReaL tree `tree`, and what was done per key."""
    t = TreeEditor(copy.deepcopy(tree))
    for rule in RULES:
        rule(t)
    return t.out, t.rows
