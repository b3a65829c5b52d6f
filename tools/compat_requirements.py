"""Requirements of the compatibility venv: SGLang's torch stack plus Flywheel's other deps.

The GPU image runs the trainer on the torch that the pinned SGLang release requires (NCCL
refuses ranks built against different NCCL versions), and SGLang pins transformers and
tokenizers too. Flywheel's own venv stays on its CPU torch and transformers 4, so `make
test-compat` runs a marked subset of the suite (`-m compat`) in a second venv on SGLang's
stack. This script keeps that venv honest without a second, hand-kept dependency list:

    python tools/compat_requirements.py --wheel SGLANG.whl                # print requirements
    python tools/compat_requirements.py --wheel SGLANG.whl --check        # exit 1 on drift

The printed list is SGLang's exact pins of the packages in `SGLANG_STACK` (read from the
wheel's METADATA, `Requires-Dist`), then every dependency of `pyproject.toml` (core and the
extras given by `--extras`) whose name is not in that stack. pip cannot lift the main pins
(`torch==2.13.0`, `transformers<5`) with a constraints file, which is why the project itself
is installed with `--no-deps` next to this list. `--check` compares the running
interpreter's installed versions with SGLang's pins, so the tests never run on a venv left
behind by an older pin. Only the standard library and `packaging` (a transformers
dependency, so present in both venvs).
"""

from __future__ import annotations

import argparse
import email.parser
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent

# The packages whose versions SGLang decides for the whole GPU image: the torch build (its
# NCCL) and the model/tokenizer library the trainer and the engines load checkpoints with.
SGLANG_STACK = ("torch", "transformers", "tokenizers")


def sglang_pins(wheel: Path) -> dict[str, Requirement]:
    """SGLang's own requirement of each `SGLANG_STACK` package, from the wheel's METADATA."""
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        if len(names) != 1:
            raise SystemExit(f"{wheel}: expected one .dist-info/METADATA, found {names}")
        meta = email.parser.Parser().parsestr(zf.read(names[0]).decode())
    pins: dict[str, Requirement] = {}
    for line in meta.get_all("Requires-Dist") or []:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        if name in SGLANG_STACK and (req.marker is None or req.marker.evaluate({"extra": ""})):
            pins[name] = req
    missing = [n for n in SGLANG_STACK if n not in pins]
    if missing:
        raise SystemExit(f"{wheel}: no Requires-Dist for {missing}; update SGLANG_STACK")
    return pins


def project_requirements(extras: list[str]) -> list[Requirement]:
    """The core dependencies of pyproject.toml plus those of the named extras."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise SystemExit(f"unknown extra {extra!r}; pyproject.toml has {sorted(optional)}")
        lines.extend(optional[extra])
    return [Requirement(line) for line in lines]


def requirements(wheel: Path, extras: list[str]) -> list[str]:
    """SGLang's stack pins first, then the project's other requirements, one per line."""
    pins = sglang_pins(wheel)
    rest = [r for r in project_requirements(extras) if canonicalize_name(r.name) not in pins]
    return [str(pins[n]) for n in SGLANG_STACK] + [str(r) for r in rest]


def drift(wheel: Path) -> list[str]:
    """Each stack package whose installed version SGLang's pin does not allow, described."""
    problems = []
    for name, req in sglang_pins(wheel).items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            problems.append(f"{name}: not installed (SGLang requires {req})")
            continue
        # A local build tag (torch's "+cpu", "+cu130") names the build, not the release.
        if not req.specifier.contains(installed.split("+", 1)[0], prereleases=True):
            problems.append(f"{name}: {installed} installed, SGLang requires {req}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheel", type=Path, required=True, help="the pinned SGLang wheel")
    parser.add_argument("--extras", default="dev,smol,tracking", help="pyproject extras to include")
    parser.add_argument(
        "--check", action="store_true", help="check this interpreter's installed stack"
    )
    args = parser.parse_args(argv)
    if args.check:
        problems = drift(args.wheel)
        for p in problems:
            print(p, file=sys.stderr)
        if problems:
            print("rebuild the venv: rm -r .venv-compat && make test-compat", file=sys.stderr)
        return 1 if problems else 0
    extras = [e for e in args.extras.split(",") if e]
    print("\n".join(requirements(args.wheel, extras)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
