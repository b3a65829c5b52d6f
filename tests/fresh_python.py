"""Run a snippet in a fresh interpreter at the repository root: what a module imports is
only visible in a process that has imported nothing else (the suite itself loads torch)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_fresh(code: str) -> subprocess.CompletedProcess[str]:
    """`python -c code` in a new process, from the repository root."""
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
