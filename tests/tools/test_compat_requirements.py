"""`tools/compat_requirements.py`: the compat venv's requirements from SGLang's wheel.

The pins come from a wheel's METADATA (`Requires-Dist`), so these tests write small wheels
with chosen lines; the last one reads the real SGLang wheel when `FLYWHEEL_SGLANG_SRC` names
it (`make test` does) and holds it to the pins recorded in the pinned SGLang schema.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "compat_requirements", ROOT / "tools" / "compat_requirements.py"
)
assert _spec is not None and _spec.loader is not None
tool = importlib.util.module_from_spec(_spec)
sys.modules["compat_requirements"] = tool
_spec.loader.exec_module(tool)


def _wheel(tmp_path: Path, requires: list[str]) -> Path:
    """A wheel holding only a METADATA with these `Requires-Dist` lines."""
    path = tmp_path / "sglang-0.0.1-py3-none-any.whl"
    lines = ["Metadata-Version: 2.4", "Name: sglang", "Version: 0.0.1"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("sglang-0.0.1.dist-info/METADATA", "\n".join(lines) + "\n")
    return path


def _installed(name: str) -> str:
    return metadata.version(name).split("+", 1)[0]


def test_the_wheels_pins_replace_the_projects_own(tmp_path: Path) -> None:
    wheel = _wheel(
        tmp_path,
        [
            "aiohttp",
            "torch==9.9.1",
            'torch==1.0; extra == "old"',  # an optional extra's pin is not what pip installs
            "Transformers==8.0.0",  # names compare canonicalized
            "tokenizers==0.99.0",
            'av==16.1.0; sys_platform == "linux" and platform_machine == "aarch64"',
        ],
    )
    reqs = [Requirement(line) for line in tool.requirements(wheel, ["smol"])]
    assert [(canonicalize_name(r.name), str(r.specifier)) for r in reqs[:3]] == [
        ("torch", "==9.9.1"),
        ("transformers", "==8.0.0"),
        ("tokenizers", "==0.99.0"),
    ]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    expected = [
        Requirement(line)
        for line in project["dependencies"] + project["optional-dependencies"]["smol"]
        if Requirement(line).name not in tool.SGLANG_STACK
    ]
    # Everything else is the project's own list, in its order; nothing of SGLang's but the stack.
    assert [str(r) for r in reqs[3:]] == [str(r) for r in expected]
    assert [canonicalize_name(r.name) for r in reqs].count("transformers") == 1
    assert "aiohttp" not in {r.name for r in reqs}


def test_a_wheel_without_a_stack_pin_or_an_unknown_extra_is_refused(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path, ["torch==9.9.1", "transformers==8.0.0"])
    with pytest.raises(SystemExit, match="tokenizers"):
        tool.sglang_pins(wheel)
    with pytest.raises(SystemExit, match="no Requires-Dist"):
        tool.sglang_pins(_wheel(tmp_path, []))
    with pytest.raises(SystemExit, match="unknown extra 'gpu'"):
        tool.project_requirements(["gpu"])


def test_check_passes_on_this_venvs_stack_and_names_a_drifted_package(tmp_path: Path) -> None:
    # torch's local build tag ("+cpu") is not part of the pinned release.
    same = [f"{n}=={_installed(n)}" for n in tool.SGLANG_STACK]
    assert tool.drift(_wheel(tmp_path, same)) == []
    assert tool.main(["--check", "--wheel", str(_wheel(tmp_path, same))]) == 0
    moved = ["torch==0.0.1", *same[1:]]
    problems = tool.drift(_wheel(tmp_path, moved))
    installed = metadata.version("torch")
    assert problems == [f"torch: {installed} installed, SGLang requires torch==0.0.1"]
    assert tool.main(["--check", "--wheel", str(_wheel(tmp_path, moved))]) == 1


def test_the_pinned_sglang_wheel_agrees_with_the_pinned_schema() -> None:
    src = os.environ.get("FLYWHEEL_SGLANG_SRC", "")
    if not src.endswith(".whl") or not Path(src).is_file():
        pytest.skip("FLYWHEEL_SGLANG_SRC names no SGLang .whl (make test downloads it)")
    from tests.rollout.sglang_standin import SCHEMA

    pins = tool.sglang_pins(Path(src))
    recorded = SCHEMA["requires"]["pins"]
    assert {n: str(pins[n].specifier) for n in recorded} == recorded
    assert str(pins["tokenizers"].specifier).startswith("==")
