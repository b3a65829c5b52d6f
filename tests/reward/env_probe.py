"""A reward function that reports whether a value is in its environment (registered by
dotted path `tests.reward.env_probe:sees`); follows the reward-function contract."""

from __future__ import annotations

import os
from typing import Any


def sees(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    answer: str,
    **kwargs: Any,
) -> float:
    """1.0 when some environment variable holds `answer`, else 0.0."""
    return float(any(answer in value for value in os.environ.values()))
