"""The images, checked statically (no Docker engine here): the Dockerfiles parse into the
stages we expect, every runtime stage runs as a non-root user, every service target starts
a module that exists, and the entrypoint script dispatches as documented (run for real)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
SERVICES = ("buffer", "reward", "rollout", "trainer")


def parse_dockerfile(path: Path) -> list[dict]:
    """Stages as {'base', 'name', 'instructions': [(KEYWORD, args)]}; line continuations
    joined, comments and the parser directive skipped."""
    lines, buf = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        lines.append(buf + line)
        buf = ""
    stages: list[dict] = []
    for line in lines:
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            parts = args.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append({"base": parts[0], "name": name, "instructions": []})
        elif stages:
            stages[-1]["instructions"].append((keyword, args.strip()))
        else:
            assert keyword == "ARG", f"{path.name}: {keyword} before the first FROM"
    return stages


def last(stage_chain: list[dict], keyword: str) -> str | None:
    for stage in reversed(stage_chain):
        for kw, args in reversed(stage["instructions"]):
            if kw == keyword:
                return args
    return None


def chain(stages: list[dict], name: str) -> list[dict]:
    """The stage and the stages it is built FROM, base first."""
    by_name = {s["name"]: s for s in stages}
    out = [by_name[name]]
    while out[0]["base"] in by_name:
        out.insert(0, by_name[out[0]["base"]])
    return out


@pytest.mark.parametrize(
    "dockerfile,targets",
    [
        ("Dockerfile.cpu", ("buffer", "reward", "rollout", "trainer", "runtime")),
        ("Dockerfile.gpu", ("rollout", "trainer", "sglang", "runtime")),
    ],
)
def test_multi_stage_non_root_and_one_entrypoint_per_service(dockerfile, targets):
    stages = parse_dockerfile(DOCKER / dockerfile)
    names = [s["name"] for s in stages]
    assert "builder" in names and "runtime" in names
    # build tools stay in the builder: the runtime starts from a fresh base image
    runtime = chain(stages, "runtime")
    assert len(runtime) == 1 and any(
        kw == "COPY" and "--from=builder" in a for kw, a in runtime[0]["instructions"]
    )
    for target in targets:
        stage_chain = chain(stages, target)
        user = last(stage_chain, "USER")
        assert user is not None, f"{dockerfile}:{target} has no USER"
        uid = user.split(":")[0]
        assert uid.isdigit() and int(uid) != 0, f"{dockerfile}:{target} runs as {user}"
        entrypoint = last(stage_chain, "ENTRYPOINT")
        assert entrypoint is not None and entrypoint.startswith("[")
        if target in SERVICES:
            assert entrypoint == f'["/usr/local/bin/flywheel-entrypoint", "{target}"]'
    if dockerfile == "Dockerfile.gpu":
        sglang = last(chain(stages, "sglang"), "ENTRYPOINT")
        assert sglang == '["/opt/venv/bin/python", "-m", "sglang.launch_server"]'


@pytest.mark.parametrize("service", SERVICES)
def test_every_service_entry_module_exists(service):
    spec = importlib.util.find_spec(f"services.{service}.__main__")
    assert spec is not None, f"python -m services.{service} has no entry module yet"


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.gpu"])
def test_copied_sources_exist_and_pass_the_dockerignore(dockerfile):
    ignore = (DOCKER / f"{dockerfile}.dockerignore").read_text().splitlines()
    allowed = [p[1:] for p in ignore if p.startswith("!")]
    for stage in parse_dockerfile(DOCKER / dockerfile):
        for kw, args in stage["instructions"]:
            if kw != "COPY" or "--from=" in args:
                continue
            sources = [a for a in args.split() if not a.startswith("--")][:-1]
            for src in sources:
                assert (ROOT / src).exists(), f"{dockerfile}: COPY {src} does not exist"
                assert any(
                    fnmatch(src, pat) or fnmatch(src + "/x", pat) or src == pat.rstrip("/*")
                    for pat in allowed
                ), f"{dockerfile}: {src} is excluded by the .dockerignore"


def run_entrypoint(*args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    base["PATH"] = f"{Path(sys.executable).parent}:{base['PATH']}"
    base["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        ["sh", str(DOCKER / "entrypoint.sh"), *args],
        capture_output=True,
        text=True,
        env={**base, **env},
        cwd=ROOT,
        timeout=120,
    )


def test_entrypoint_refuses_an_unknown_service():
    result = run_entrypoint("scheduler")
    assert result.returncode == 64
    assert (
        "unknown service 'scheduler'" in result.stderr
        and "buffer reward rollout trainer" in result.stderr
    )


@pytest.mark.parametrize("service", ["buffer", "reward"])
def test_entrypoint_starts_the_service_module(service):
    """`--help` goes through the real `python -m services.<name>` argument parser."""
    result = run_entrypoint(service, "--help", FLYWHEEL_CONFIG="/nonexistent.yaml")
    assert result.returncode == 0, result.stderr
    assert f"python -m services.{service}" in result.stdout


def test_entrypoint_passes_config_file_and_overrides(tmp_path):
    """A bad override must reach the service's config loader, which names it: proof that
    FLYWHEEL_CONFIG and FLYWHEEL_OVERRIDES arrive as `--config FILE key=value`."""
    config = tmp_path / "flywheel.yaml"
    config.write_text("actor: {kl_ctl: 0.0}\n")
    result = run_entrypoint(
        "reward", FLYWHEEL_CONFIG=str(config), FLYWHEEL_OVERRIDES="reward.num_workers=0"
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "reward.num_workers" in result.stderr


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.gpu"])
def test_builds_offline_with_the_engines_own_frontend(dockerfile):
    """No `# syntax=` directive (it made BuildKit pull a frontend image from a registry before
    parsing anything); every pip step can trust a CA bundle given as the build secret
    `pip_ca`, and no certificate or pip setting is written into an image."""
    text = (DOCKER / dockerfile).read_text()
    assert not re.search(r"^#\s*syntax\s*=", text, re.IGNORECASE | re.MULTILINE)
    stages = parse_dockerfile(DOCKER / dockerfile)
    pip_runs = [
        args
        for s in stages
        for kw, args in s["instructions"]
        if kw == "RUN" and "pip install" in args
    ]
    assert pip_runs
    for args in pip_runs:
        assert args.startswith("--mount=type=secret,id=pip_ca "), args
        assert "PIP_CERT=/run/secrets/pip_ca" in args
    for stage in stages:
        for kw, args in stage["instructions"]:
            assert not (kw == "ENV" and "PIP_CERT" in args), args
            assert not (kw == "COPY" and re.search(r"\.(crt|pem)\b", args)), args
    if dockerfile == "Dockerfile.cpu":
        assert {s["base"] for s in stages if s["name"] in ("builder", "runtime")} == {
            "${PYTHON_IMAGE}"
        }


def test_offline_override_names_only_build_inputs_and_local_images():
    """deploy/docker/compose.offline.yml changes the build inputs (base image, torch index,
    build network, CA secret) and the images of Redis and Prometheus, nothing else."""
    import yaml

    offline = yaml.safe_load((DOCKER / "compose.offline.yml").read_text())
    for name in SERVICES + ("prepare",):
        build = offline["services"][name]["build"]
        assert set(build) == {"network", "args", "secrets"} and build["network"] == "host"
        assert set(build["args"]) == {"PYTHON_IMAGE", "TORCH_INDEX_URL", "PIP_INDEX_URL"}
        assert set(offline["services"][name]) == {"build"}
    assert offline["services"]["grafana"] == {"profiles": ["grafana"]}
    assert set(offline["services"]) == {*SERVICES, "prepare", "redis", "prometheus", "grafana"}
    assert set(offline["secrets"]) == {"pip_ca"}
