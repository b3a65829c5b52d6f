"""A short real `flywheel run` for the deploy tests: started as a user starts it, stopped
as a user stops it (SIGTERM to the launcher), and checked to leave no process behind.

The run is given far more steps than a test waits for, so that it is still training
whenever it is looked at; the test ends it. Its address book is the `services.json` the
launcher writes before any service starts, the same file `flywheel status` reads.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from tests.run_configs import tiny_run_config

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def small_config(fileroot: Path) -> dict[str, Any]:
    """The shared tiny run, given far more steps than the test waits for."""
    # never reached: the test stops the run
    return tiny_run_config(fileroot, experiment="scrape", steps=100_000)


def wait_for(
    predicate: Callable[[], T],
    what: str,
    timeout: float = 90.0,
    alive: Callable[[], None] | None = None,
) -> T:
    """Poll until `predicate` returns something truthy; `alive` raises when what is being
    waited on has died, so a crash is reported as a crash and not as a timeout."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if alive is not None:
            alive()
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.25)


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time in clock ticks) of a live process, or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # the command name may contain spaces
    return int(fields[1]), fields[0], int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """Every process below `root`, as pid -> start time (a pid alone may be reused)."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
            children.setdefault(st[0], []).append((int(entry.name), st[2]))
    out: dict[int, int] = {}
    stack = [root]
    while stack:
        for pid, start in children.get(stack.pop(), []):
            out[pid] = start
            stack.append(pid)
    return out


def still_running(procs: dict[int, int]) -> list[int]:
    """The pids of `procs` that are the same process and not yet a zombie."""
    alive = []
    for pid, start in procs.items():
        st = _stat(pid)
        if st is not None and st[2] == start and st[1] != "Z":
            alive.append(pid)
    return alive


class LocalRun:
    """`python -m services.cli run --config FILE` in its own session, logging to a file."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.config = workdir / "run.yaml"
        self.config.write_text(yaml.safe_dump(small_config(workdir / "runs")))
        self.run_dir = workdir / "runs" / "scrape" / "t"
        self.log = workdir / "launcher.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> LocalRun:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        env.pop("FLYWHEEL_TOKEN", None)
        with open(self.log, "wb") as sink:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "services.cli", "run", "--config", str(self.config)],
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # our signal reaches the launcher alone, as `kill` does
            )
        return self

    def alive(self) -> None:
        """Raise with the launcher's last output when the run has ended."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"flywheel run exited with {self.proc.returncode}:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def addresses(self, timeout: float = 90.0) -> dict[str, Any]:
        """The launcher's address book, once written."""
        path = self.run_dir / "services.json"

        def read() -> dict[str, Any] | None:
            with contextlib.suppress(OSError, ValueError):
                return json.loads(path.read_text())
            return None

        return wait_for(read, "services.json", timeout, self.alive)

    def stop(self, timeout: float = 120.0) -> list[int]:
        """SIGTERM the launcher (it stops its services in reverse order), wait, and return
        the pids of its process tree that outlived it (killed here, so nothing leaks)."""
        assert self.proc is not None
        tree = descendants(self.proc.pid)
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # The launcher's children die with it (PR_SET_PDEATHSIG); give them a moment.
        deadline = time.monotonic() + 10.0
        while still_running(tree) and time.monotonic() < deadline:
            time.sleep(0.2)
        leftovers = still_running(tree)
        for pid in leftovers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return leftovers
