"""`orphan_proof`: the wrapped program keeps its pid and dies when its parent is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from services.common.proc import orphan_proof


def test_the_wrapped_program_keeps_the_pid_and_sees_argv_env_and_cwd(tmp_path: Path) -> None:
    code = "import os,sys; print(os.getpid(), sys.argv[1:], os.environ['X'], os.getcwd())"
    proc = subprocess.Popen(
        orphan_proof([sys.executable, "-c", code, "a b", "c"]),
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "X": "42"},
        cwd=tmp_path,
    )
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert out.split(" ", 1)[0] == str(proc.pid)
    assert f"['a b', 'c'] 42 {tmp_path}" in out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_the_child_dies_when_its_parent_is_sigkilled(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    parent_code = (
        "import subprocess, sys, time\n"
        "from services.common.proc import orphan_proof\n"
        "p = subprocess.Popen(orphan_proof(['sleep', '600']))\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(600)\n"
    )
    root = Path(__file__).resolve().parents[2]
    parent = subprocess.Popen([sys.executable, "-c", parent_code], cwd=root)
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and parent.poll() is None
        time.sleep(0.05)
    child = int(pid_file.read_text())
    while "sleep" not in Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace"):
        assert time.monotonic() < deadline  # still the shim: wait for its exec
        time.sleep(0.02)
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=30)
    while _alive(child):  # killed by the kernel; pytest-timeout bounds the wait
        time.sleep(0.05)
