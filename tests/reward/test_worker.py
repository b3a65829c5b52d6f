"""Worker logic (`services/reward/worker.py`) called in-process: every failure of a
function becomes an ERROR result with its message, never an exception."""

from __future__ import annotations

import pytest

from services.reward.worker import Worker, as_reward

FAULTY = "tests.reward.faulty"


def item(fn: str, completion: str = "#### 3", answer: str = "3", **kwargs: object) -> dict:
    return {
        "id": 0,
        "fn": fn,
        "prompt": "p",
        "completion": completion,
        "prompt_ids": [1, 2, 3],
        "completion_ids": [4],
        "answer": answer,
        "kwargs": kwargs,
    }


def test_ok_error_and_bad_return_values() -> None:
    w = Worker(cpu_seconds=0, memory_bytes=0)
    ok = w.score(item("services.reward.builtins:arithmetic_reward"))
    assert (ok["status"], ok["reward"], ok["message"]) == ("OK", 1.0, "")
    assert ok["t1"] >= ok["t0"]
    raised = w.score(item(f"{FAULTY}:raises"))
    assert raised["status"] == "ERROR" and raised["message"] == "ValueError: bad answer field '3'"
    assert w.score(item(f"{FAULTY}:returns_nan"))["message"].startswith(
        "ValueError: reward function returned nan"
    )
    assert "returned str" in w.score(item(f"{FAULTY}:returns_text"))["message"]
    missing = w.score(item("no_such_pkg_xyz:fn"))
    assert missing["status"] == "ERROR" and "ModuleNotFoundError" in missing["message"]
    assert not any(r["restart"] for r in (ok, raised, missing))


def test_kwargs_and_ids_reach_the_function() -> None:
    w = Worker(cpu_seconds=0, memory_bytes=0)
    # echo_kwargs: weight * len(prompt_ids) + (prompt == "p") = 2.5 * 3 + 1 = 8.5
    assert w.score(item(f"{FAULTY}:echo_kwargs", weight=2.5))["reward"] == 8.5


@pytest.mark.parametrize(("value", "expected"), [(True, 1.0), (0, 0.0), (0.25, 0.25)])
def test_as_reward_accepts_real_numbers(value: object, expected: float) -> None:
    assert as_reward(value) == expected


@pytest.mark.parametrize("value", [None, "1", [1.0], float("inf")])
def test_as_reward_refuses_the_rest(value: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        as_reward(value)
