"""Reward functions that misbehave on purpose, for the fault tests (registered by dotted
path `tests.reward.faulty:<name>`). Each follows the reward-function contract."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any


def raises(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    answer: str,
    **kwargs: Any,
) -> float:
    raise ValueError(f"bad answer field {answer!r}")


def loops_forever(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    answer: str,
    **kwargs: Any,
) -> float:
    n = 0
    while True:
        n += 1


def sleeps(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    answer: str,
    seconds: float = 3600.0,
    **kwargs: Any,
) -> float:
    time.sleep(seconds)
    return 1.0


def allocates_forever(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    answer: str,
    **kwargs: Any,
) -> float:
    hoard = []
    while True:
        hoard.append(bytearray(64 << 20))


def exits_process(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    answer: str,
    **kwargs: Any,
) -> float:
    os._exit(7)


def returns_nan(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    answer: str,
    **kwargs: Any,
) -> float:
    return float("nan")


def returns_text(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    answer: str,
    **kwargs: Any,
) -> float:
    return "1.0"  # type: ignore[return-value]


def prints_and_scores(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    answer: str,
    **kwargs: Any,
) -> float:
    print("noise on stdout that must not corrupt the worker protocol", flush=True)
    return float(len(completion_ids))


def swallows_everything(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    answer: str,
    **kwargs: Any,
) -> float:
    """Burns CPU inside `except Exception` so only the CPU limit (a BaseException) or the
    deadline can stop it."""
    while True:
        with contextlib.suppress(Exception):  # the point of the test
            sum(i * i for i in range(10_000))


def echo_kwargs(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    answer: str,
    **kwargs: Any,
) -> float:
    """Reward = the dataset field `weight` times the number of prompt ids (checks that
    ids and kwargs arrive intact)."""
    return float(kwargs.get("weight", 0.0)) * len(prompt_ids) + (1.0 if prompt == "p" else 0.0)
