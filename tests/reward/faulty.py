"""Reward functions that misbehave on purpose, for the fault tests (registered by dotted
path `tests.reward.faulty:<name>`). Each follows the reward-function contract."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from services.reward.errors import InvalidInput


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


def refuses_answer(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    answer: str,
    **kwargs: Any,
) -> float:
    """A user function that finds the item's reference unusable, as the contract allows."""
    raise InvalidInput(f"answer {answer!r} names no test case")


def _stat_line(pid: int) -> str:
    """`pid start ppid sid` of a live process, from /proc/<pid>/stat (proc(5) fields 1, 22,
    4, 6)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return f"{pid} {fields[19]} {fields[1]} {fields[3]}"


def starts_helpers(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    answer: str,
    pid_file: str = "",
    then: str = "hang",
    **kwargs: Any,
) -> float:
    """Starts two `sleep 600` out of reach of a kill of the worker's process group: one in
    a session of its own (`start_new_session=True`), one left behind by a shell that ran
    it in the background and exited (so it is orphaned: its parent is now whoever reaps
    orphans). Writes `pid start ppid sid` of each, then of the worker itself, to
    `pid_file`; then hangs (`then="hang"`) or ends the worker (`then="exit"`)."""
    own_session = subprocess.Popen(
        ["sleep", "600"],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    shell = subprocess.run(
        ["sh", "-c", "sleep 600 </dev/null >/dev/null 2>&1 & echo $!"],
        start_new_session=True,
        capture_output=True,
        text=True,
        check=True,
    )
    orphan = int(shell.stdout)
    lines = [_stat_line(pid) for pid in (own_session.pid, orphan, os.getpid())]
    tmp = Path(pid_file + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.rename(pid_file)  # whole or absent, for a reader polling it
    if then == "exit":
        os._exit(5)
    time.sleep(3600)
    return 1.0
