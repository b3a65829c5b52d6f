"""A reward worker process: `python -m services.reward.worker`, driven by the service.

Why a process (not a thread): a reward function may loop, hang in a C extension, or
allocate without bound; only a process can be killed and only a process has its own
limits. math-verify's own timeouts also need a main thread, which a worker has.

Start-up: the protocol moves to private descriptors and fd 0/1 become /dev/null and
stderr, so a function that prints cannot corrupt the frames. Then the `init` frame sets
the memory limit (RLIMIT_AS, for the whole process) and the CPU limit (RLIMIT_CPU,
re-armed before every call so it is per call: the soft limit sends SIGXCPU, which we turn
into an exception). Items are scored one after another; each result is written as soon
as it exists, so the service can time the next item's deadline from this one's end.

After a MemoryError or a CPU-limit hit the worker reports the item and exits: its heap
or interpreter state may be half-broken, and a fresh process is cheap. A function that
raises `InvalidInput` (the built-ins do, for a missing or unreadable reference answer)
gets INVALID_INPUT for that item; the worker stays.

The worker is a child subreaper: whatever its functions start and orphan (a `setsid`
helper, a daemon's double fork) is re-parented to it, so the service finds and kills it
with the worker (`services.reward.reaper`). An adopted process that exits stays a zombie
until the worker is replaced: reaping by `waitpid(-1)` here would also take the exit
statuses of the function's own `subprocess` children.
"""

from __future__ import annotations

import math
import numbers
import os
import resource
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from services.reward.errors import InvalidInput
from services.reward.protocol import read_frame_fd, write_frame_fd
from services.reward.reaper import become_subreaper
from services.reward.registry import load_callable

MAX_MESSAGE_CHARS = 2000
_WARMUP_ARGS = ("What is 1 + 1?", "1 + 1 = 2\n#### 2", [1], [2], "2")


class CpuLimitExceeded(BaseException):  # noqa: N818 - named for what the user reads
    """Raised from the SIGXCPU handler when a call used its CPU seconds. A BaseException so
    that a function's own `except Exception:` cannot swallow it."""


def _on_sigxcpu(signum: int, frame: Any) -> None:
    # Lift the soft limit first so the kernel stops repeating SIGXCPU while we report.
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    resource.setrlimit(resource.RLIMIT_CPU, (hard, hard))
    raise CpuLimitExceeded("CPU time limit for one call exceeded")


def _cpu_used() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _arm_cpu_limit(cpu_seconds: float) -> None:
    if cpu_seconds <= 0:
        return
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = int(math.ceil(_cpu_used() + cpu_seconds))
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _disarm_cpu_limit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    resource.setrlimit(resource.RLIMIT_CPU, (hard, hard))


def _apply_memory_limit(memory_bytes: int) -> None:
    if memory_bytes <= 0:
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = memory_bytes if hard == resource.RLIM_INFINITY else min(memory_bytes, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def as_reward(value: Any) -> float:
    """The function's return value as a finite float, or a TypeError/ValueError saying why."""
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, numbers.Real):
        raise TypeError(f"reward function returned {type(value).__name__}, expected a float")
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"reward function returned {reward}, expected a finite float")
    return reward


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 3] + "..."


class Worker:
    def __init__(self, cpu_seconds: float, memory_bytes: int) -> None:
        self.cpu_seconds = cpu_seconds
        self.memory_bytes = memory_bytes
        self._fns: dict[str, Callable[..., Any]] = {}

    def function(self, path: str) -> Callable[..., Any]:
        fn = self._fns.get(path)
        if fn is None:
            fn = load_callable(path)
            self._fns[path] = fn
        return fn

    def score(self, item: dict[str, Any]) -> dict[str, Any]:
        """Run one item; never raises (every failure becomes an ERROR result)."""
        t0 = time.monotonic()
        status, reward, message, restart, reason = "OK", 0.0, "", False, ""
        try:
            _arm_cpu_limit(self.cpu_seconds)
            try:
                fn = self.function(item["fn"])
                value = fn(
                    item["prompt"],
                    item["completion"],
                    item["prompt_ids"],
                    item["completion_ids"],
                    item["answer"],
                    **item["kwargs"],
                )
            finally:
                _disarm_cpu_limit()
            reward = as_reward(value)
        except MemoryError as exc:
            limit_mib = self.memory_bytes >> 20
            status, restart, reason = "ERROR", True, "memory"
            message = f"MemoryError: worker memory limit of {limit_mib} MiB reached ({exc})"
        except CpuLimitExceeded:
            status, restart, reason = "ERROR", True, "cpu"
            message = f"CpuLimitExceeded: call used more than {self.cpu_seconds:g} CPU seconds"
        except InvalidInput as exc:
            status, message = "INVALID_INPUT", _describe(exc)
        except BaseException as exc:  # noqa: BLE001 - user code may raise anything, even SystemExit
            status, message = "ERROR", _describe(exc)
        return {
            "op": "result",
            "id": item["id"],
            "status": status,
            "reward": reward if status == "OK" else 0.0,
            "message": message,
            "t0": t0,
            "t1": time.monotonic(),
            "restart": restart,
            "reason": reason,
        }

    def warmup(self, path: str) -> None:
        """Call a built-in once so lazy imports and parser tables are not charged to the
        first real item's deadline."""
        try:
            self.function(path)(*_WARMUP_ARGS)
        except Exception as exc:  # noqa: BLE001 - warm-up is best effort
            print(f"reward worker: warm-up of {path} failed: {_describe(exc)}", file=sys.stderr)


PARENT_PID_ENV = "FLYWHEEL_REWARD_SERVICE_PID"


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this worker when the service dies (even by SIGKILL): a worker
    stuck in a loop would otherwise outlive it, since it leads its own session.

    The service passes its pid in FLYWHEEL_REWARD_SERVICE_PID; a different parent pid
    after the signal is armed means the service died first (the worker was re-parented).
    Parent pid 1 alone proves nothing: in a container or a pod the service itself is pid 1.
    Without the variable (a worker started by hand) the EOF on stdin still ends it."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the EOF on stdin still ends idle workers
        pass
    expected = os.environ.get(PARENT_PID_ENV, "")
    if expected.isdigit() and os.getppid() != int(expected):  # the service died first
        os._exit(1)


def _take_private_fds() -> tuple[int, int]:
    """Move the protocol off fd 0/1 so user code's print()/input() cannot touch it."""
    proto_in, proto_out = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    return proto_in, proto_out


def begin_worker(role: str) -> tuple[int, int, dict[str, Any]] | None:
    """The start-up every worker process shares (this one and the tool worker of
    `services.reward.tools`): die with the parent, become a subreaper, move the protocol
    to private descriptors, read the init frame, take its sys.path, handle SIGXCPU.
    Returns `(proto_in, proto_out, init)`, or None when no init frame came."""
    _die_with_parent()
    become_subreaper()  # before any user code runs: nothing it starts escapes the worker
    proto_in, proto_out = _take_private_fds()
    init = read_frame_fd(proto_in)
    if init is None or init.get("op") != "init":
        print(f"{role}: expected an init frame", file=sys.stderr)
        return None
    for entry in reversed(init.get("sys_path", [])):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    signal.signal(signal.SIGXCPU, _on_sigxcpu)
    # The service handles Ctrl-C; a worker dies with its process group, not on SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return proto_in, proto_out, init


def main() -> int:
    started = begin_worker("reward worker")
    if started is None:
        return 2
    proto_in, proto_out, init = started
    worker = Worker(float(init.get("cpu_seconds", 0)), int(init.get("memory_bytes", 0)))
    for path in init.get("preload", []):
        try:
            worker.function(path)
        except Exception as exc:  # noqa: BLE001 - reported per item when it is used
            print(f"reward worker: cannot preload {path}: {_describe(exc)}", file=sys.stderr)
    for path in init.get("warmup", []):
        worker.warmup(path)
    # The limit comes after imports: they are the service's code, not the function's.
    _apply_memory_limit(worker.memory_bytes)
    write_frame_fd(proto_out, {"op": "ready", "pid": os.getpid()})
    while True:
        msg = read_frame_fd(proto_in)
        if msg is None or msg["op"] == "exit":
            return 0
        if msg["op"] != "score":
            print(f"reward worker: unknown op {msg['op']!r}", file=sys.stderr)
            return 2
        for item in msg["items"]:
            result = worker.score(item)
            write_frame_fd(proto_out, result)
            if result["restart"]:
                return 3


if __name__ == "__main__":
    sys.exit(main())
