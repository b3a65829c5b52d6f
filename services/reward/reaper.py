"""Nothing a reward function starts outlives its worker: child subreapers and tree kills.

A reward function may start processes (a proof checker's REPL, a sandboxed interpreter, a
helper it forgets) and put them in a session or process group of their own
(`setsid`, `start_new_session=True`, a daemon's double fork), where the SIGKILL to the
worker's process group does not reach them. Two Linux child subreapers
(`PR_SET_CHILD_SUBREAPER`, Linux >= 3.4) keep every such process findable:

- Each worker is a subreaper. A descendant whose parent exits (the daemon's middle
  process, a shell that ran `sleep 600 &` and returned) is re-parented to the worker,
  not to init, so while the worker lives everything its functions started is in its
  subtree of /proc, whatever session or group it moved to. Killing a worker first
  stops it (it can start nothing more), SIGKILLs that subtree (`kill_descendants`),
  then SIGKILLs the worker.
- The service process (`python -m services.reward`) is a subreaper too. When a worker
  dies on its own (os._exit, a segfault, the OOM killer) its children are re-parented to
  the service, which kills and reaps every child that is not a worker (`reap_orphans`).

Why not a cgroup, which would hold every descendant however it moves: creating one needs
a delegated, writable cgroup v2 subtree (systemd's `Delegate=`, a privileged or specially
configured container). The reward service runs unprivileged, under the launcher or in
a default pod, and gets none. A subreaper needs no privilege and works in both. Where a
cgroup exists anyway (a pod's), it still bounds the whole service.

What a subreaper does not catch: a process handed to another parent on purpose (through
`systemd-run`, `at`, a container runtime), which never was the worker's descendant; and
the descendants of workers when the service itself is SIGKILLed: the workers die with it
(`PR_SET_PDEATHSIG`), and their orphans go to the service's nearest subreaper or init (a
container's init kills everything in its pid namespace when it exits).

Processes are named by (pid, start time) and signalled through a pidfd opened after the
start time was checked again, so a pid reused in between is never signalled.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from collections.abc import Collection
from dataclasses import dataclass

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


@dataclass(frozen=True)
class ProcInfo:
    """One line of /proc/<pid>/stat, the fields used here (proc(5))."""

    pid: int
    ppid: int
    state: str  # "Z": exited, waiting to be reaped
    start: int  # start time after boot, in clock ticks: with the pid, names one process


def become_subreaper() -> bool:
    """Make this process the parent of its orphaned descendants; False where Linux's prctl
    is not available (then orphans go to init, as before)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def read_proc(pid: int) -> ProcInfo | None:
    """The process `pid` as /proc shows it now, or None when there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = stat.rsplit(b")", 1)[1].split()
    return ProcInfo(pid, int(fields[1]), fields[0].decode(), int(fields[19]))


def snapshot() -> dict[int, ProcInfo]:
    """Every process /proc lists now (empty where there is no /proc)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return {}
    procs: dict[int, ProcInfo] = {}
    for name in names:
        if name.isdigit():
            info = read_proc(int(name))
            if info is not None:
                procs[info.pid] = info
    return procs


def send_signal(proc: ProcInfo, sig: int) -> bool:
    """Signal `proc` if its pid still names the process that was scanned; True if sent."""
    fd: int | None = None
    try:
        fd = os.pidfd_open(proc.pid)
    except ProcessLookupError:
        return False
    except (AttributeError, OSError):  # no pidfd (Linux < 5.3): the start-time check only
        fd = None
    try:
        now = read_proc(proc.pid)
        if now is None or now.start != proc.start:
            return False
        if fd is None:
            os.kill(proc.pid, sig)
        else:
            signal.pidfd_send_signal(fd, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False
    finally:
        if fd is not None:
            os.close(fd)


def _kill_tree(root: int, root_start: int | None, killed: set[tuple[int, int]]) -> None:
    """SIGKILL every live descendant of `root` (not `root`), scanning again until a scan
    finds none not yet killed: one forked between a scan and its parent's kill shows up
    in the next scan (a killed process cannot fork any more, so this ends)."""
    for _ in range(64):  # a bound against a fork bomb outrunning the scans
        procs = snapshot()
        top = procs.get(root)
        if top is None or (root_start is not None and top.start != root_start):
            return  # gone, or the pid now names another process: nothing of ours below
        children: dict[int, list[ProcInfo]] = {}
        for p in procs.values():
            children.setdefault(p.ppid, []).append(p)
        found: list[ProcInfo] = []
        seen = {root}
        stack = [root]
        while stack:
            for child in children.get(stack.pop(), ()):
                if child.pid in seen:
                    continue
                seen.add(child.pid)
                stack.append(child.pid)
                if child.state != "Z" and (child.pid, child.start) not in killed:
                    found.append(child)
        if not found:
            return
        for p in found:
            if send_signal(p, signal.SIGKILL):
                killed.add((p.pid, p.start))


def kill_descendants(
    root: int, root_start: int | None = None, killed: set[tuple[int, int]] | None = None
) -> int:
    """SIGKILL every process below `root` in the process tree, whatever session or group
    it is in; returns how many were killed now (those already in `killed`, which is
    updated, are not signalled again). Stop `root` first if it may still fork.
    `root_start` (the root's `ProcInfo.start`) guards against a reused pid."""
    done = killed if killed is not None else set()
    before = len(done)
    _kill_tree(root, root_start, done)
    return len(done) - before


def reap_orphans(keep: Collection[int], killed: set[tuple[int, int]]) -> int:
    """One pass over this process's children that are not in `keep` (the workers): each
    is SIGKILLed with everything below it and reaped once it has exited. Adds what it
    killed to `killed`; returns how many such children are still there (killed but not
    exited yet): call again until 0.

    Only for a process whose every child other than `keep` is an orphan it adopted as a
    subreaper: it reaps by pid, never with `waitpid(-1)`, so the workers' own exit
    statuses stay with the code that waits for them."""
    me = os.getpid()
    left = 0
    for p in snapshot().values():
        if p.ppid != me or p.pid in keep:
            continue
        if p.state != "Z":
            _kill_tree(p.pid, p.start, killed)
            if (p.pid, p.start) not in killed and send_signal(p, signal.SIGKILL):
                killed.add((p.pid, p.start))
        with contextlib.suppress(ChildProcessError):
            pid, _ = os.waitpid(p.pid, os.WNOHANG)
            if pid == 0:
                left += 1
    return left
