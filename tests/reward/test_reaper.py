"""Process-tree kills (`services/reward/reaper.py`) on real processes: every descendant
dies whatever session it moved to, the root is left alone, and a root whose pid now
names another process (a different start time) is not touched."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from services.reward import reaper
from tests.reward.conftest import process_identity, wait_gone


def sleeping_children(pid: int, timeout: float = 30.0) -> list[reaper.ProcInfo]:
    """The children of `pid` once two run `sleep` (bounded wait: the shell forks them, and
    one runs `setsid` before it becomes `sleep`)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [
            p
            for p in reaper.snapshot().values()
            if p.ppid == pid and p.state != "Z" and comm(p.pid) == "sleep"
        ]
        if len(found) >= 2 or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def test_kill_descendants_reaches_other_sessions_and_spares_the_root() -> None:
    # A shell with two children: one in its process group, one in a session of its own
    # (`setsid` in a background job calls setsid() itself: the job leads no group).
    root = subprocess.Popen(
        ["sh", "-c", "sleep 600 & setsid sleep 600 & wait"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    kids: list[reaper.ProcInfo] = []
    try:
        info = reaper.read_proc(root.pid)
        assert info is not None
        kids = sleeping_children(root.pid)
        assert len(kids) == 2
        sessions = {(os.getsid(k.pid) == k.pid) for k in kids}
        assert sessions == {True, False}  # one leads its own session, one does not

        # A stale name for the root (another start time): nothing below it is ours.
        assert reaper.kill_descendants(root.pid, info.start + 1) == 0
        assert [process_identity(k.pid) for k in kids] == [(k.pid, k.start) for k in kids]

        killed: set[tuple[int, int]] = set()
        assert reaper.kill_descendants(root.pid, info.start, killed) == 2
        assert killed == {(k.pid, k.start) for k in kids}
        assert reaper.kill_descendants(root.pid, info.start, killed) == 0  # none twice
        assert wait_gone([(k.pid, k.start) for k in kids]) == []
        assert root.wait(timeout=30) == 0  # the root was not killed: its `wait` returned
    finally:
        for k in kids:
            if process_identity(k.pid) == (k.pid, k.start):
                os.kill(k.pid, signal.SIGKILL)
        if root.poll() is None:
            root.kill()
            root.wait()


def test_read_proc_names_a_process_by_pid_and_start_time() -> None:
    me = reaper.read_proc(os.getpid())
    assert me is not None and me.ppid == os.getppid() and me.state in "RS"
    assert reaper.read_proc(2**22 + 1) is None  # above pid_max: no such process
    assert process_identity(os.getpid()) == (me.pid, me.start)
