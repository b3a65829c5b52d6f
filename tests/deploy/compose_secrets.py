"""The variables deploy/docker/secrets.sh prints for the compose stack's `.env` (every
secret docker-compose.yml requires), made by running the script for real."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def stack_secrets() -> dict[str, str]:
    """A fresh set: role tokens, the servers' digests, Redis, SGLang and Grafana passwords."""
    out = subprocess.run(
        ["sh", str(ROOT / "deploy" / "docker" / "secrets.sh")],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return dict(line.split("=", 1) for line in out.splitlines())
