"""The GPU deployment of SGLang, held to SGLang's own wheel: the image's versions, one Python
environment, what its kernel compilers need, writable caches under a read-only root, probes
that do not generate, and weights handed over on a volume both containers mount.

The reference is the pinned SGLang wheel: its METADATA (`Requires-Dist`) and source, read
from `FLYWHEEL_SGLANG_SRC` (the `.whl` or the unpacked wheel, as `tests/tools/
test_sglang_schema.py` takes it) when set, else from `tests/rollout/sglang_schema.json`,
which `tools/sglang_schema.py --check` proves equal to that wheel.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from tests.deploy.conftest import load_module
from tests.deploy.test_compose import SECRETS, resolved
from tests.deploy.test_docker import chain, parse_dockerfile
from tests.deploy.test_helm_chart import containers, one, trainer_job
from tests.rollout.sglang_standin import SCHEMA, SGLangStandIn

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile.gpu"
CHART = ROOT / "deploy" / "helm" / "flywheel"
GPU_VALUES = CHART / "ci" / "gpu-8-values.yaml"
VENV_PYTHON = "/opt/venv/bin/python"

SCHEMA_TOOL = load_module(ROOT / "tools" / "sglang_schema.py", "sglang_schema_tool")

# SGLang 0.5.23 `srt/environ.py` `third_party_cache_defaults`: the caches it points under
# SGLANG_CACHE_DIR. Read from the wheel when it is here; this copy is what is checked
# without it (and is compared with the wheel when it is).
THIRD_PARTY_CACHES = {
    "TRITON_CACHE_DIR",
    "TORCHINDUCTOR_CACHE_DIR",
    "CUDA_CACHE_PATH",
    "TILELANG_CACHE_DIR",
    "FLASHINFER_WORKSPACE_BASE",
}
# What else writes under HOME or names a cache: SGLang's own cache root (`~/.cache/sglang`),
# XDG users, the Hugging Face hub.
CACHE_VARIABLES = {"HOME", "XDG_CACHE_HOME", "HF_HOME", "SGLANG_CACHE_DIR", *THIRD_PARTY_CACHES}


def _wheel() -> Any:
    src = os.environ.get("FLYWHEEL_SGLANG_SRC", "")
    return SCHEMA_TOOL.Source(Path(src)) if src and Path(src).exists() else None


def sglang_requires() -> dict[str, Any]:
    """The wheel's pins of torch and transformers and its CUDA extras."""
    wheel = _wheel()
    if wheel is None:
        return SCHEMA["requires"]
    got = SCHEMA_TOOL._requires(wheel.metadata())
    assert got == SCHEMA["requires"], "the pinned schema is stale: rerun tools/sglang_schema.py"
    return got


def third_party_caches() -> set[str]:
    wheel = _wheel()
    if wheel is None:
        return THIRD_PARTY_CACHES
    tree = ast.parse(wheel.read("sglang/srt/environ.py"))
    [fn] = [
        n
        for n in tree.body
        if isinstance(n, ast.FunctionDef) and n.name == "third_party_cache_defaults"
    ]
    [ret] = [n for n in ast.walk(fn) if isinstance(n, ast.Return)]
    assert isinstance(ret.value, ast.Dict)
    keys = {ast.literal_eval(k) for k in ret.value.keys if k is not None}
    assert keys == THIRD_PARTY_CACHES, f"SGLang's caches changed: {keys}"
    return keys


def build_args() -> dict[str, str]:
    """Every `ARG NAME=default` of the Dockerfile (global and per stage)."""
    out: dict[str, str] = {}
    for line in DOCKERFILE.read_text().splitlines():
        m = re.match(r"ARG\s+(\w+)=(\S+)", line.strip())
        if m:
            assert m.group(1) not in out, f"ARG {m.group(1)} given twice"
            out[m.group(1)] = m.group(2)
    return out


def runs(stage: dict[str, Any]) -> list[str]:
    return [args for kw, args in stage["instructions"] if kw == "RUN"]


# ----------------------------------------------------------------------------- the image


def test_image_pins_the_clients_sglang_and_sglangs_own_torch_on_cuda_13():
    args = build_args()
    # The version the client and the stand-in are written against.
    assert args["SGLANG_VERSION"] == SCHEMA["sglang_version"] == "0.5.23"
    requires = sglang_requires()
    assert requires["pins"]["torch"] == f"=={args['TORCH_VERSION']}"
    # SGLang's kernels are its CUDA 13 builds: the base image and torch's index follow.
    [cuda] = requires["cuda_extras"]
    major = cuda.removeprefix("cu")
    assert re.fullmatch(
        rf"nvidia/cuda:{major}\.\d+\.\d+-cudnn-devel-ubuntu\d+\.\d+", args["CUDA_DEVEL_IMAGE"]
    )
    assert args["TORCH_INDEX_URL"].rsplit("/", 1)[1].startswith(f"cu{major}")
    # transformers is SGLang's too: Flywheel's requirements are installed without the pins
    # SGLang sets, Flywheel itself with --no-deps.
    assert requires["pins"]["transformers"].startswith("==")
    [builder] = [s for s in parse_dockerfile(DOCKERFILE) if s["name"] == "builder"]
    text = " ".join(runs(builder))
    assert '"sglang==${SGLANG_VERSION}" "torch==${TORCH_VERSION}"' in text
    assert "'torch', 'transformers', 'tokenizers'" in text and "pip install --no-deps ." in text
    assert "assert torch.__version__.split('+')[0] == '${TORCH_VERSION}'" in text


def test_one_python_environment_for_trainer_rollout_and_sglang():
    """NCCL refuses ranks built against different NCCL versions: the trainer and SGLang's
    workers must import the same torch, so there is one environment and everything starts
    from it."""
    stages = parse_dockerfile(DOCKERFILE)
    text = DOCKERFILE.read_text()
    assert re.findall(r"python3 -m venv (\S+)", text) == ["/opt/venv"]
    for stage in stages:
        for args in runs(stage):
            # every pip is the environment's (PATH), none of another interpreter
            assert not re.search(r"/\S+/bin/pip\b", args), args
    runtime = chain(stages, "runtime")[-1]
    copies = [a for kw, a in runtime["instructions"] if kw == "COPY" and "--from=builder" in a]
    assert copies == ["--from=builder /opt/venv /opt/venv"]
    sglang = [a for kw, a in chain(stages, "sglang")[-1]["instructions"] if kw == "ENTRYPOINT"]
    assert sglang == [f'["{VENV_PYTHON}", "-m", "sglang.launch_server"]']


def test_runtime_can_compile_kernels():
    """Triton builds a C launcher at start-up (gcc, Python.h); flashinfer and DeepGEMM
    compile CUDA kernels on first use (nvcc: the CUDA devel image)."""
    stages = parse_dockerfile(DOCKERFILE)
    [runtime] = chain(stages, "runtime")
    assert runtime["base"] == "${CUDA_DEVEL_IMAGE}"
    installs = [a for a in runs(runtime) if "apt-get install" in a]
    assert installs
    packages = set(" ".join(installs).split())
    assert {"build-essential", "python3-dev"} <= packages


# ----------------------------------------------------------------- chart and compose parts


@pytest.fixture(scope="module")
def chart(helm_check) -> list[dict[str, Any]]:
    return helm_check.render(helm_check.load_values(GPU_VALUES))


@pytest.fixture(scope="module")
def pod(chart) -> dict[str, dict[str, Any]]:
    sts = one(chart, "StatefulSet", "flywheel-rollout")
    return {
        "containers": {c["name"]: c for c in containers(sts)},
        "volumes": {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]},
    }


@pytest.fixture(scope="module")
def stack(compose_binary) -> dict[str, Any]:
    return resolved(compose_binary, "--profile", "gpu")["services"]


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def _under(path: str, root: str) -> bool:
    return PurePosixPath(path).is_relative_to(PurePosixPath(root))


def test_sglang_caches_are_writable_under_a_read_only_root(pod, stack):
    wanted = {"HOME", "XDG_CACHE_HOME", "HF_HOME", "SGLANG_CACHE_DIR", *third_party_caches()}
    assert wanted == CACHE_VARIABLES
    # Chart: a read-only root, each cache on a writable pod volume.
    sglang = pod["containers"]["sglang"]
    assert sglang["securityContext"]["readOnlyRootFilesystem"] is True
    writable = [
        m["mountPath"]
        for m in sglang["volumeMounts"]
        if not m.get("readOnly") and "emptyDir" in pod["volumes"][m["name"]]
    ]
    env = _env(sglang)
    for var in sorted(wanted):
        assert var in env, f"chart: SGLang's {var} is not set"
        assert any(_under(env[var], w) for w in writable), f"chart: {var}={env[var]}"
    # Compose: a read-only root, each cache on a tmpfs or a volume mounted read-write.
    svc = stack["sglang"]
    assert svc["read_only"] is True
    writable = list(svc.get("tmpfs", [])) + [
        v["target"] for v in svc["volumes"] if not v.get("read_only")
    ]
    for var in sorted(wanted):
        value = svc["environment"].get(var)
        assert value and any(_under(value, w) for w in writable), f"compose: {var}={value}"


def _probe_commands(pod, stack) -> Iterator[tuple[str, list[str]]]:
    sglang = pod["containers"]["sglang"]
    assert {"startupProbe", "livenessProbe", "readinessProbe"} <= set(sglang)
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        yield f"chart {kind}", sglang[kind]["exec"]["command"]
    test = stack["sglang"]["healthcheck"]["test"]
    assert test[0] == "CMD"
    yield "compose healthcheck", test[1:]


def _on_port(command: list[str], port: int) -> list[str]:
    assert command[0] == VENV_PYTHON and command[1] == "-c"
    script = re.sub(r"127\.0\.0\.1:\d+/", f"127.0.0.1:{port}/", command[2])
    return [sys.executable, "-c", script]


def test_probes_do_not_generate_and_pass_while_paused(pod, stack, tiny_model_dir):
    """Each probe of the chart and compose, run for real against the stand-in started with
    an API key and paused (as during a weight update): SGLang's /health generates a token
    and would fail here (`health_generate`); /ping (`sagemaker_health`) is a flag check
    but sits behind the key, which the probe reads from the container's environment."""
    routes = SCHEMA["routes"]
    assert routes["/health"]["handler"] == "health_generate"
    assert routes["/ping"]["handler"] == "sagemaker_health"
    key = SECRETS["SGLANG_API_KEY"]
    standin = SGLangStandIn(tiny_model_dir, api_key=key).start()
    try:
        standin.paused = True
        for where, command in _probe_commands(pod, stack):
            paths = re.findall(r"127\.0\.0\.1:\d+(/\w+)", command[2])
            assert paths == ["/ping"], f"{where} probes {paths}"
            assert routes["/ping"]["methods"] == ["GET"]
            run = _on_port(command, standin.port)
            with_key = {"PATH": os.environ["PATH"], "SGLANG_API_KEY": key}
            ok = subprocess.run(run, env=with_key, capture_output=True, text=True, timeout=60)
            assert ok.returncode == 0, f"{where}: {ok.stderr}"
            refused = subprocess.run(
                run, env={"PATH": os.environ["PATH"]}, capture_output=True, text=True, timeout=60
            )
            assert refused.returncode != 0 and "401" in refused.stderr, where
        # What the probes were: /health, failing while paused.
        old = _on_port(
            [
                VENV_PYTHON,
                "-c",
                "import urllib.request as u; u.urlopen('http://127.0.0.1:1/health', timeout=5)",
            ],
            standin.port,
        )
        failed = subprocess.run(old, capture_output=True, text=True, timeout=60)
        assert failed.returncode != 0 and "503" in failed.stderr
    finally:
        standin.stop()
    assert standin.contract_errors == []
    assert standin.refused == ["/ping"] * 4


def test_the_chart_gives_the_sglang_container_the_api_key(pod):
    env = {e["name"]: e for e in pod["containers"]["sglang"]["env"]}
    assert "secretKeyRef" in env["SGLANG_API_KEY"]["valueFrom"]


# ------------------------------------------------------------------------ weight handover


def _mounts_chart(pod, name: str) -> dict[str, str]:
    """mountPath -> volume of a container of the rollout pod."""
    return {m["mountPath"]: m["name"] for m in pod["containers"][name]["volumeMounts"]}


def _volume_of(mounts: dict[str, str], path: str) -> tuple[str, str] | None:
    best = None
    for mount, volume in mounts.items():
        if _under(path, mount) and (best is None or len(mount) > len(best[0])):
            best = (mount, volume)
    return best


def _handover(cfg: Any) -> tuple[str, str]:
    """What the rollout sends SGLang (built by the engine's own `from_config`) and where the
    trainer publishes (the trainer's own run paths)."""
    from services.rollout.engine.sglang_engine import SGLangEngine
    from services.trainer.paths import RunPaths

    eng = SGLangEngine.from_config(cfg, tokenizer_path=cfg.actor.path)
    return str(eng.scratch_dir), str(RunPaths.from_config(cfg).weight_dir)


def test_chart_hands_weights_over_on_a_volume_both_containers_mount(chart, pod, tmp_path):
    from services.common.config import load_config

    rollout = pod["containers"]["rollout"]
    config = yaml.safe_load(one(chart, "ConfigMap", "flywheel-config")["data"]["flywheel.yaml"])
    (tmp_path / "flywheel.yaml").write_text(yaml.safe_dump(config))
    overrides = [a for a in rollout["args"] if "=" in a and not a.startswith("--")]
    cfg = load_config(str(tmp_path / "flywheel.yaml"), overrides)
    assert cfg.rollout.engine == "sglang"
    handover, published = _handover(cfg)
    side = _mounts_chart(pod, "rollout")
    server = _mounts_chart(pod, "sglang")
    for path in (handover, published):
        here, there = _volume_of(side, path), _volume_of(server, path)
        assert here is not None and here == there, f"{path}: rollout {here}, sglang {there}"
        assert "persistentVolumeClaim" in pod["volumes"][here[1]]
    # ...and it is the volume the trainer publishes on.
    [tc] = containers(trainer_job(chart))
    tmounts = {m["mountPath"]: m["name"] for m in tc["volumeMounts"]}
    assert _volume_of(tmounts, published) == _volume_of(side, published)


def test_chart_refuses_sglang_without_the_shared_volume(helm_check):
    values = helm_check.load_values(GPU_VALUES)
    values["sharedStorage"] = {**values.get("sharedStorage", {}), "enabled": False}
    with pytest.raises(Exception, match="needs sharedStorage.enabled"):
        helm_check.render(values)


def test_compose_hands_weights_over_on_a_volume_both_containers_mount(stack):
    """The config every service loads is `prepare`'s output: the demo config with the
    compose file's `prepare` overrides, plus each service's own; rebuilt here from those."""
    from services.common.config import load_config

    prepare = stack["prepare"]["command"]
    rollout_overrides = shlex.split(stack["rollout-gpu"]["environment"]["FLYWHEEL_OVERRIDES"])
    cfg = load_config(str(ROOT / "examples" / "demo.yaml"), [*prepare[3:], *rollout_overrides])
    handover, published = _handover(cfg)

    def mounts(name: str) -> dict[str, str]:
        return {
            v["target"]: v["source"]
            for v in stack[name]["volumes"]
            if v["type"] == "volume" and not v.get("read_only")
        }

    for path in (handover, published):
        here = _volume_of(mounts("rollout-gpu"), path)
        assert here is not None and here == _volume_of(mounts("sglang"), path), path
    assert _volume_of(mounts("trainer-gpu"), published) == _volume_of(mounts("sglang"), published)
    assert json.dumps(stack["sglang"]["volumes"]).count("flywheel-data") == 1


def test_the_kubernetes_launcher_runs_sglang_as_the_chart_does(pod):
    """`flywheel run` with `scheduler.type: kubernetes` renders the chart: once it built its
    own SGLang container, with the defects the chart lost (a `/health` probe that generates,
    HF_HOME alone under a read-only root, the old `/opt/sglang` interpreter). The engine
    `sglang` must turn on the chart's container: its caches, interpreter and probes."""
    from services.common.config import load_config
    from services.launcher import kubernetes as k8s

    cfg = load_config(
        str(ROOT / "examples" / "grpo.yaml"),
        [
            "actor.path=/shared/models/m",
            "train_dataset.path=/shared/data/train.jsonl",
            "valid_dataset.path=/shared/data/valid.jsonl",
            "rollout.engine=sglang",
            "trainer.backend=nccl",
            "trainer.device=cuda",
        ],
    )
    [sts] = [
        o
        for o in k8s.manifests(cfg)
        if o["kind"] == "StatefulSet" and o["metadata"]["name"].endswith("-rollout")
    ]
    spec = sts["spec"]["template"]["spec"]
    ours = {c["name"]: c for c in spec["containers"]}["sglang"]
    theirs = pod["containers"]["sglang"]
    assert ours["command"][0] == theirs["command"][0] == VENV_PYTHON
    cache_env = {k: v for k, v in _env(theirs).items() if k in CACHE_VARIABLES}
    assert {k: v for k, v in _env(ours).items() if k in CACHE_VARIABLES} == cache_env
    volumes = {v["name"]: v for v in spec["volumes"]}
    writable = [
        m["mountPath"]
        for m in ours["volumeMounts"]
        if not m.get("readOnly") and "emptyDir" in volumes[m["name"]]
    ]
    assert all(any(_under(v, w) for w in writable) for v in cache_env.values())
    port = int(theirs["args"][theirs["args"].index("--port") + 1])
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        mine = ours[kind]["exec"]["command"]
        assert _on_port(mine, port) == _on_port(theirs[kind]["exec"]["command"], port), kind
        assert "/ping" in mine[2] and "/health" not in mine[2]
