"""Child-process hygiene shared by everything that spawns servers."""

from __future__ import annotations

import signal


def die_with_parent() -> None:
    """`preexec_fn` for Popen: ask Linux to SIGKILL the child when its parent dies, so a
    parent killed without cleanup (OOM, SIGKILL, a test timeout) leaves no orphans."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the parent's own cleanup still applies
        pass
