"""The committed stubs are what `make proto` generates from proto/ (stale stubs fail here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_stubs_are_up_to_date():
    proc = subprocess.run(
        [sys.executable, "tools/gen_proto.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def test_check_mode_notices_a_stale_stub(tmp_path):
    """--check compares byte for byte: a stub edited by hand is reported by name."""
    stub = ROOT / "flywheel_proto" / "v1" / "common_pb2.pyi"
    original = stub.read_bytes()
    try:
        stub.write_bytes(original + b"# edited by hand\n")
        proc = subprocess.run(
            [sys.executable, "tools/gen_proto.py", "--check"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
    finally:
        stub.write_bytes(original)
    assert proc.returncode == 1
    assert "common_pb2.pyi" in proc.stderr
