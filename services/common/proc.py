"""Child-process hygiene shared by everything that spawns servers.

Children are asked to die with their parent (Linux `PR_SET_PDEATHSIG`), so a parent killed
without cleanup (OOM, SIGKILL, a test timeout) leaves no orphans. This is NOT done with
Popen's `preexec_fn`: that forces a plain fork(), which runs gRPC's fork handlers in the
child; they restart gRPC's poller thread there, and when Popen then closes the inherited
descriptors the poller hits a closed epoll fd and aborts the child (seen as redis-server
"exiting" with SIGABRT and a gRPC line in its stderr, once in a few dozen starts). Instead a
tiny interpreter (stdlib only, no site) sets the signal and execs the real program, keeping
the pid, and Popen is free to use vfork, which runs no fork handlers.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

_SHIM = """
import ctypes, os, signal, sys
try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):  # not Linux: the parent's own cleanup still applies
    pass
if os.getppid() != int(sys.argv[1]):  # the parent died before the signal was armed
    os._exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def orphan_proof(argv: Sequence[str]) -> list[str]:
    """`argv` wrapped so the program is SIGKILLed when this process dies; same pid, same
    environment and working directory (Popen's own arguments apply unchanged)."""
    return [sys.executable, "-I", "-S", "-c", _SHIM, str(os.getpid()), *argv]
