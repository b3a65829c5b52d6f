"""The Helm chart, rendered offline by the real Helm engine and validated strictly.

Every `ci/*-values.yaml` (and the defaults) renders, lints clean, and every object
validates against the newest Kubernetes schemas kubernetes-validate ships (strict: unknown
fields are errors) or, for custom resources, against the prometheus-operator and KEDA
CRD models. Then the properties the issue asks for are checked on what was rendered.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "flywheel"
CI_FILES = sorted(p.name for p in (CHART / "ci").glob("*-values.yaml"))


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [
        o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]


def one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = find(objects, kind, name)
    assert len(found) == 1, (
        f"expected one {kind}/{name}, got {[o['metadata']['name'] for o in find(objects, kind)]}"
    )
    return found[0]


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return obj["spec"]["template"]["spec"]["containers"]


@pytest.fixture(scope="module")
def rendered(helm_check) -> dict[str, list[dict[str, Any]]]:
    out = {"default": helm_check.render({})}
    for name in CI_FILES:
        out[name] = helm_check.render(helm_check.load_values(CHART / "ci" / name))
    return out


def test_every_ci_values_file_is_present():
    assert CI_FILES == [
        "autoscaling-values.yaml",
        "cpu-small-values.yaml",
        "external-redis-values.yaml",
        "gpu-8-values.yaml",
    ]


@pytest.mark.parametrize("case", ["default", *CI_FILES])
def test_renders_and_validates_strictly(helm_check, rendered, case):
    objects = rendered[case]
    assert len(objects) >= 15
    assert helm_check.validate_objects(objects) == []


@pytest.mark.parametrize("case", [None, *CI_FILES])
def test_lints_clean(helm_check, case):
    values = helm_check.load_values(CHART / "ci" / case) if case else {}
    assert helm_check.lint(values) == []


def test_validation_catches_a_bad_object(helm_check, rendered):
    """The validator itself must fail on what it should fail on, for both paths."""
    sts = copy.deepcopy(one(rendered["default"], "StatefulSet", "flywheel-trainer"))
    sts["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["grpc"]["portt"] = 1
    errors = helm_check.validate_objects([sts])
    assert len(errors) == 1 and "portt" in errors[0]
    sm = copy.deepcopy(one(rendered["gpu-8-values.yaml"], "ServiceMonitor", "flywheel"))
    sm["spec"]["endpoints"][0]["scrapeInterval"] = "5s"  # the field is `interval`
    assert helm_check.validate_objects([sm]) == [
        "ServiceMonitor/flywheel: unknown field .spec.endpoints[0].scrapeInterval"
    ]


def test_schema_rejects_bad_values_and_accepts_ci_values():
    import helm_python as helm

    with helm.Chart.load(CHART) as chart:
        for name in CI_FILES:
            chart.validate_schema(yaml.safe_load((CHART / "ci" / name).read_text()))
        bad = {
            "buffer.replicaCount": {"buffer": {"replicaCount": 2}},
            "trainer.backend": {"trainer": {"backend": "mpi"}},
            "redis.appendfsync": {"redis": {"appendfsync": "sometimes"}},
            "podSecurityContext.runAsNonRoot": {"podSecurityContext": {"runAsNonRoot": False}},
            "rollout.sglang.memFractionStatic": {"rollout": {"sglang": {"memFractionStatic": 1.5}}},
            "extraOverrides": {"extraOverrides": ["not an override"]},
            "unknown top-level key": {"replicas": 3},
        }
        for field, values in bad.items():
            with pytest.raises(helm.HelmValuesError) as err:
                chart.validate_schema(values)
            assert field.split(".")[-1].split(" ")[0] in str(
                err.value
            ) or "additional properties" in str(err.value), field
        with pytest.raises(helm.HelmError, match="trainer/backend"):
            chart.render({"trainer": {"backend": "mpi"}}, name="x")


def test_topology_default(rendered):
    objects = rendered["default"]
    trainer = one(objects, "StatefulSet", "flywheel-trainer")
    headless = one(objects, "Service", "flywheel-trainer-headless")
    assert trainer["spec"]["serviceName"] == "flywheel-trainer-headless"
    assert (
        headless["spec"]["clusterIP"] == "None"
        and headless["spec"]["publishNotReadyAddresses"] is True
    )
    assert {p["name"] for p in headless["spec"]["ports"]} == {"grpc", "metrics", "rendezvous"}
    command = containers(trainer)[0]["command"]
    assert command[0] == "torchrun" and command[-2:] == ["-m", "services.trainer"]
    assert "--node-rank=$(POD_INDEX)" in command
    rollout = one(objects, "StatefulSet", "flywheel-rollout")
    assert [c["name"] for c in containers(rollout)] == ["rollout"]  # no SGLang on CPU
    assert containers(rollout)[0]["args"][2:4] == ["--replica-index", "$(POD_INDEX)"]
    for name in ("flywheel-buffer", "flywheel-reward"):
        dep = one(objects, "Deployment", name)
        assert containers(dep)[0]["command"] == ["python", "-m", f"services.{name.split('-')[1]}"]
    assert one(objects, "Deployment", "flywheel-buffer")["spec"]["strategy"]["type"] == "Recreate"
    assert not find(objects, "ServiceMonitor") and not find(objects, "PrometheusRule")
    assert not find(objects, "HorizontalPodAutoscaler") and not find(objects, "ScaledObject")


def test_probes_are_native_grpc_with_service_names(rendered):
    services = {
        "flywheel-buffer": "flywheel.v1.BufferService",
        "flywheel-reward": "flywheel.v1.RewardService",
        "flywheel-rollout": "flywheel.v1.RolloutService",
        "flywheel-trainer": "flywheel.v1.TrainerService",
    }
    for obj in find(rendered["default"], "Deployment") + find(rendered["default"], "StatefulSet"):
        name = obj["metadata"]["name"]
        if name not in services:
            continue
        c = containers(obj)[0]
        for probe in ("startupProbe", "readinessProbe"):
            assert c[probe]["grpc"] == {"port": 50051, "service": services[name]}, (name, probe)
        assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}


@pytest.mark.parametrize("case", ["default", *CI_FILES])
def test_every_pod_is_non_root_with_read_only_root(rendered, case):
    for obj in find(rendered[case], "Deployment") + find(rendered[case], "StatefulSet"):
        pod = obj["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, obj["metadata"]["name"]
        assert pod["securityContext"]["runAsUser"] > 0
        assert pod["automountServiceAccountToken"] is False
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert (
                sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            ), c["name"]
            assert sc["capabilities"]["drop"] == ["ALL"]


def test_redis_has_aof_a_volume_a_password_and_only_the_buffer_reaches_it(rendered):
    objects = rendered["default"]
    redis = one(objects, "StatefulSet", "flywheel-redis")
    script = containers(redis)[0]["command"][2]
    assert "--appendonly yes" in script and "--appendfsync everysec" in script
    assert "$REDIS_PASSWORD" in script and "requirepass" in script
    assert (
        redis["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"]
        == "8Gi"
    )
    secret = one(objects, "Secret", "flywheel-redis")
    assert len(secret["data"]["redis-password"]) > 0
    policy = one(objects, "NetworkPolicy", "flywheel-redis")
    [rule] = policy["spec"]["ingress"]
    assert rule["from"] == [
        {
            "podSelector": {
                "matchLabels": {
                    "app.kubernetes.io/name": "flywheel",
                    "app.kubernetes.io/instance": "flywheel",
                    "app.kubernetes.io/component": "buffer",
                }
            }
        }
    ]
    assert rule["ports"] == [{"port": 6379, "protocol": "TCP"}]
    env = {
        e["name"]: e for e in containers(one(objects, "Deployment", "flywheel-buffer"))[0]["env"]
    }
    assert env["FLYWHEEL_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "flywheel-redis",
        "key": "redis-password",
    }
    assert env["FLYWHEEL_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "flywheel-token",
        "key": "token",
    }


def test_rendered_config_loads_and_points_at_the_chart_objects(rendered):
    from services.common.config import FlywheelConfig

    cm = one(rendered["default"], "ConfigMap", "flywheel-config")
    data = yaml.safe_load(cm["data"]["flywheel.yaml"])
    cfg = FlywheelConfig.model_validate({**data, "actor": {"kl_ctl": 0.0}})
    domain = "flywheel.svc.cluster.local"
    assert cfg.buffer.redis_url == f"redis://flywheel-redis.{domain}:6379/0"
    assert cfg.services.buffer.address == f"flywheel-buffer.{domain}:50051"
    assert (
        cfg.services.rollout.replica_address(3)
        == f"flywheel-rollout-3.flywheel-rollout-headless.{domain}:50051"
    )
    assert cfg.trainer.master_addr == f"flywheel-trainer-0.flywheel-trainer-headless.{domain}"
    assert "auth_token" not in data["services"] and data["buffer"].get("redis_password") is None


def test_gpu_layout(rendered):
    objects = rendered["gpu-8-values.yaml"]
    rollout = one(objects, "StatefulSet", "flywheel-rollout")
    assert rollout["spec"]["replicas"] == 4
    sglang = {c["name"]: c for c in containers(rollout)}["sglang"]
    assert sglang["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert sglang["args"][:2] == ["--model-path", "/data/shared/models/Qwen2.5-1.5B-Instruct"]
    trainer = one(objects, "StatefulSet", "flywheel-trainer")
    assert containers(trainer)[0]["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert "--nproc-per-node=4" in containers(trainer)[0]["command"]
    data = yaml.safe_load(one(objects, "ConfigMap", "flywheel-config")["data"]["flywheel.yaml"])
    # user config merged over the derived one: both present
    assert data["trainer"]["n_ranks"] == 4 and data["trainer"]["backend"] == "nccl"
    assert (
        data["rollout"]["engine"] == "sglang"
        and data["rollout"]["sglang"]["url"] == "http://127.0.0.1:30000"
    )
    assert data["rollout"]["max_head_offpolicyness"] == 4 and data["rollout"]["n_replicas"] == 4
    assert trainer["spec"]["template"]["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"


def test_metrics_objects_carry_the_shared_alerts_and_dashboards(rendered):
    objects = rendered["gpu-8-values.yaml"]
    rule = one(objects, "PrometheusRule", "flywheel")
    alerts = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"]
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    monitor = one(objects, "ServiceMonitor", "flywheel")
    assert monitor["spec"]["jobLabel"] == "flywheel.io/job"
    monitored = [
        o
        for o in find(objects, "Service")
        if o["metadata"]["labels"].get("flywheel.io/metrics") == "true"
    ]
    assert sorted(o["metadata"]["labels"]["flywheel.io/job"] for o in monitored) == [
        "flywheel-buffer",
        "flywheel-reward",
        "flywheel-rollout",
        "flywheel-trainer",
    ]
    boards = find(objects, "ConfigMap")
    boards = [b for b in boards if b["metadata"]["labels"].get("grafana_dashboard") == "1"]
    assert sorted(k for b in boards for k in b["data"]) == [
        "flywheel-rl-health.json",
        "flywheel-system.json",
    ]
    for b in boards:
        for name, text in b["data"].items():
            assert (
                text.strip()
                == (ROOT / "deploy" / "grafana" / "dashboards" / name).read_text().strip()
            )


def test_external_redis(rendered):
    objects = rendered["external-redis-values.yaml"]
    assert not find(objects, "StatefulSet", "flywheel-redis") and not find(objects, "Secret")
    data = yaml.safe_load(one(objects, "ConfigMap", "flywheel-config")["data"]["flywheel.yaml"])
    assert data["buffer"]["redis_url"] == "redis://redis-master.data.svc.cluster.local:6379/0"
    env = {
        e["name"]: e for e in containers(one(objects, "Deployment", "flywheel-buffer"))[0]["env"]
    }
    assert env["FLYWHEEL_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "flywheel-redis",
        "key": "redis-password",
    }
    assert env["FLYWHEEL_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "flywheel-token",
        "key": "token",
    }


def test_autoscaling_keda_and_hpa(helm_check, rendered):
    objects = rendered["autoscaling-values.yaml"]
    scaled = {o["metadata"]["name"]: o for o in find(objects, "ScaledObject")}
    assert set(scaled) == {"flywheel-rollout", "flywheel-reward"}
    assert scaled["flywheel-rollout"]["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"
    assert scaled["flywheel-rollout"]["spec"]["maxReplicaCount"] == 6
    assert (
        scaled["flywheel-rollout"]["spec"]["triggers"][0]["metadata"]["query"]
        == "sum(flywheel_buffer_capacity_groups)"
    )
    assert (
        scaled["flywheel-reward"]["spec"]["triggers"][0]["metadata"]["query"]
        == "sum(flywheel_reward_queue_items)"
    )
    assert "replicas" not in one(objects, "StatefulSet", "flywheel-rollout")["spec"]
    data = yaml.safe_load(one(objects, "ConfigMap", "flywheel-config")["data"]["flywheel.yaml"])
    assert data["rollout"]["n_replicas"] == 6 and data["trainer"]["weight_transport"] == "disk"
    # the same values with the HPA path: External metrics, and still strictly valid
    values = helm_check.load_values(CHART / "ci" / "autoscaling-values.yaml")
    values["autoscaling"]["keda"] = False
    hpa_objects = helm_check.render(values)
    assert helm_check.validate_objects(hpa_objects) == []
    hpas = {o["metadata"]["name"]: o for o in find(hpa_objects, "HorizontalPodAutoscaler")}
    assert (
        hpas["flywheel-rollout"]["spec"]["metrics"][0]["external"]["metric"]["name"]
        == "flywheel_buffer_capacity_groups"
    )
    assert hpas["flywheel-reward"]["spec"]["metrics"][0]["external"]["target"] == {
        "type": "AverageValue",
        "averageValue": "16",
    }


def test_pod_disruption_budgets(rendered):
    pdbs = {
        o["metadata"]["name"]: o["spec"]
        for o in find(rendered["gpu-8-values.yaml"], "PodDisruptionBudget")
    }
    assert pdbs["flywheel-trainer"]["minAvailable"] == 1  # every rank of the one node
    assert pdbs["flywheel-rollout"]["maxUnavailable"] == 1
    assert pdbs["flywheel-redis"]["minAvailable"] == 1


def test_readme_parameters_table_is_current_and_complete(helm_check):
    assert helm_check.param_problems() == []
    assert helm_check.readme_is_current(), "run python tools/helm_check.py --write-readme"
    table = helm_check.params_table()
    assert "| `trainer.nprocPerNode` | Ranks per pod (GPUs per pod on GPU nodes) | `1` |" in table
