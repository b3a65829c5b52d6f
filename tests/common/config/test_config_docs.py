"""`docs/config.md` is generated from the config models (`tools/gen_config_docs.py`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.common.config import FlywheelConfig
from services.common.config.key_hints import all_paths

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tools"))

import gen_config_docs  # noqa: E402


def test_committed_reference_matches_the_models() -> None:
    # What CI runs: a field added or re-documented without regenerating fails here.
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_config_docs.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_every_key_has_a_row_in_its_block() -> None:
    text = (ROOT / "docs" / "config.md").read_text()
    for path in all_paths(FlywheelConfig):
        block, _, key = path.rpartition(".")
        heading = f"## `{block}`" if block else "## Root keys"
        section = text.split(heading + "\n", 1)[1].split("\n## ", 1)[0]
        assert f"| `{key}` |" in section, path
    assert "## Coming from AReaL" in text and "| `actor.backend`" in text


def test_check_fails_on_a_stale_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = tmp_path / "config.md"
    stale.write_text(gen_config_docs.render().replace("| `eps_clip` |", "| `eps_clip_old` |"))
    monkeypatch.setattr(gen_config_docs, "OUT", stale)
    assert gen_config_docs.main(["--check"]) == 1
    assert gen_config_docs.main([]) == 0 and gen_config_docs.main(["--check"]) == 0
