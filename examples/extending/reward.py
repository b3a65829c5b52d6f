"""Reward function: 1.0 when the completion's last number equals the answer's, else 0.0."""

import re
from typing import Any

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number_reward(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    answer: str,
    **kwargs: Any,
) -> float:
    said = NUMBER.findall(completions)
    expected = NUMBER.findall(answer)
    if not said or not expected:
        return 0.0
    return 1.0 if float(said[-1]) == float(expected[-1]) else 0.0
