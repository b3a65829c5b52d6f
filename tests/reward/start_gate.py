"""A reward module whose import ends the worker while a gate file exists: workers that
import it (every worker preloads the registered functions) cannot start while the gate
is closed. It breaks the start as a deleted virtualenv or a full disk would, with a real
process that exits before it says ready. The gate's path is in FLYWHEEL_REWARD_TEST_GATE."""

from __future__ import annotations

import os
from typing import Any

_gate = os.environ.get("FLYWHEEL_REWARD_TEST_GATE", "")
if _gate and os.path.exists(_gate):
    os._exit(3)


def score(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    answer: str,
    **kwargs: Any,
) -> float:
    return 1.0
