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
        "tls-values.yaml",
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
    sts = copy.deepcopy(one(rendered["default"], "StatefulSet", "flywheel-rollout"))
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


def trainer_job(objects: list[dict[str, Any]]) -> dict[str, Any]:
    [job] = [
        o for o in find(objects, "Job") if o["metadata"]["name"].startswith("flywheel-trainer-")
    ]
    return job


def workloads(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet", "Job")]


def test_topology_default(rendered):
    objects = rendered["default"]
    trainer = trainer_job(objects)
    headless = one(objects, "Service", "flywheel-trainer-headless")
    assert trainer["spec"]["template"]["spec"]["subdomain"] == "flywheel-trainer-headless"
    assert (
        headless["spec"]["clusterIP"] == "None"
        and headless["spec"]["publishNotReadyAddresses"] is True
    )
    assert {p["name"] for p in headless["spec"]["ports"]} == {"grpc", "metrics", "rendezvous"}
    c = containers(trainer)[0]
    assert c["command"] == ["python", "-m", "services.trainer"]  # not torchrun (see launch.py)
    assert c["args"][c["args"].index("--node-rank") + 1] == "$(POD_INDEX)"
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
    for obj in workloads(rendered["default"]):
        name = obj["metadata"]["name"]
        name = "flywheel-trainer" if name.startswith("flywheel-trainer-") else name
        if name not in services:
            continue
        c = containers(obj)[0]
        for probe in ("startupProbe", "readinessProbe"):
            assert c[probe]["grpc"] == {"port": 50051, "service": services[name]}, (name, probe)
        assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}


@pytest.mark.parametrize("case", ["default", *CI_FILES])
def test_every_pod_is_non_root_with_read_only_root(rendered, case):
    for obj in workloads(rendered[case]):
        pod = obj["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, obj["metadata"]["name"]
        assert pod["securityContext"]["runAsUser"] > 0
        assert pod["automountServiceAccountToken"] is False
        for c in pod["containers"] + pod.get("initContainers", []):
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
    # the buffer dials no Flywheel service: it checks callers against digests, holds no token
    assert "FLYWHEEL_TOKEN" not in env
    assert env["FLYWHEEL_CREDENTIALS"]["valueFrom"]["secretKeyRef"] == {
        "name": "flywheel-token",
        "key": "credentials",
    }


def chart_config(objects: list[dict[str, Any]], tmp_path: Path, shared: Path | None = None):
    """The ConfigMap's flywheel.yaml loaded by the services' own loader (`load_config`:
    interpolation, validation), the shared volume's mount path moved to `shared`."""
    from services.common.config import load_config

    text = one(objects, "ConfigMap", "flywheel-config")["data"]["flywheel.yaml"]
    if shared is not None:
        text = text.replace("/data/shared", str(shared))
    path = tmp_path / "flywheel.yaml"
    path.write_text(text)
    return load_config(str(path))


def kubernetes_pod_labels(job: dict[str, Any], index: int) -> dict[str, str]:
    """The labels Kubernetes gives pod `index` of an Indexed Job: the template's, plus
    `batch.kubernetes.io/job-name` (1.27+) and `batch.kubernetes.io/job-completion-index`
    (1.28+, PodIndexLabel), per the Job documentation."""
    return {
        **job["spec"]["template"]["metadata"]["labels"],
        "batch.kubernetes.io/job-name": job["metadata"]["name"],
        "job-name": job["metadata"]["name"],
        "batch.kubernetes.io/job-completion-index": str(index),
    }


def selects(service: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in service["spec"]["selector"].items())


def test_rendered_config_loads_and_points_at_the_chart_objects(rendered, tmp_path):
    objects = rendered["default"]
    data = yaml.safe_load(one(objects, "ConfigMap", "flywheel-config")["data"]["flywheel.yaml"])
    cfg = chart_config(objects, tmp_path)
    domain = "flywheel.svc.cluster.local"
    assert cfg.buffer.redis_url == f"redis://flywheel-redis.{domain}:6379/0"
    assert cfg.services.buffer.address == f"flywheel-buffer.{domain}:50051"
    assert (
        cfg.services.rollout.replica_address(3)
        == f"flywheel-rollout-3.flywheel-rollout-headless.{domain}:50051"
    )
    # rank 0 (rendezvous and gRPC) by a Service whose name has no revision in it, selecting
    # pod 0 of the current Job and no other pod
    assert cfg.trainer.master_addr == f"flywheel-trainer-0.{domain}"
    assert cfg.services.trainer.address == f"flywheel-trainer-0.{domain}:50051"
    rank0 = one(objects, "Service", "flywheel-trainer-0")
    assert rank0["spec"]["clusterIP"] == "None" and rank0["spec"]["publishNotReadyAddresses"]
    assert {p["name"]: p["port"] for p in rank0["spec"]["ports"]}["rendezvous"] == (
        cfg.trainer.master_port
    )
    job = trainer_job(objects)
    assert selects(rank0, kubernetes_pod_labels(job, 0))
    assert not selects(rank0, kubernetes_pod_labels(job, 1))
    old = {**job, "metadata": {**job["metadata"], "name": "flywheel-trainer-000000"}}
    assert not selects(rank0, kubernetes_pod_labels(old, 0))  # a replaced Job's pod 0
    rollout = one(objects, "StatefulSet", "flywheel-rollout")["spec"]["template"]
    assert not selects(rank0, rollout["metadata"]["labels"])
    assert "auth_token" not in data["services"] and data["buffer"].get("redis_password") is None


def test_gpu_layout(rendered):
    objects = rendered["gpu-8-values.yaml"]
    rollout = one(objects, "StatefulSet", "flywheel-rollout")
    assert rollout["spec"]["replicas"] == 4
    sglang = {c["name"]: c for c in containers(rollout)}["sglang"]
    assert sglang["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert sglang["args"][:2] == ["--model-path", "/data/shared/models/Qwen2.5-1.5B-Instruct"]
    trainer = trainer_job(objects)
    assert containers(trainer)[0]["resources"]["limits"]["nvidia.com/gpu"] == 4
    args = containers(trainer)[0]["args"]
    assert args[args.index("--nproc-per-node") + 1] == "4"
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
    assert env["FLYWHEEL_CREDENTIALS"]["valueFrom"]["secretKeyRef"] == {
        "name": "flywheel-token",
        "key": "credentials",
    }
    assert not find(objects, "Secret", "flywheel-token")  # the existing one is used


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


# --- issue: `helm install` comes up, trains and finishes ----------------------------------


@pytest.mark.parametrize("case", ["default", *CI_FILES])
def test_preflight_every_pod_would_start(helm_check, rendered, case):
    """Every Flywheel container of every pod, in its service's --check mode, with the
    ConfigMap's flywheel.yaml and its own args as the kubelet expands them. Before: every
    service exited 2 on the default kl_ctl, gpu-8 and autoscaling rollout pods on the port
    check, and rollout and trainer on the empty actor.path."""
    assert helm_check.preflight(rendered[case]) == []


def test_preflight_finds_a_pod_that_would_exit(helm_check):
    objects = helm_check.render({"config": {"actor": {"kl_ctl": 0.1}}})
    problems = helm_check.preflight(objects)
    # A KL penalty without `ref` is the trainer's problem: only its pod would exit (the
    # reward, buffer and rollout services check only the blocks they read).
    [problem] = problems
    assert "(trainer)" in problem and "actor.kl_ctl" in problem
    # a service told to bind a name that is not its own (what the 0.0.0.0 override avoids)
    objects = helm_check.render(
        {"extraOverrides": ["services.reward.host=flywheel-reward.flywheel.svc.cluster.local"]}
    )
    [problem] = [p for p in helm_check.preflight(objects) if "(reward)" in p]
    assert "does not resolve here" in problem


def test_kubelet_expansion(helm_check):
    env = {"POD_INDEX": "3"}
    assert helm_check.expand("--node-rank=$(POD_INDEX)", env) == "--node-rank=3"
    assert helm_check.expand("$(UNSET) and $$(POD_INDEX)", env) == "$(UNSET) and $(POD_INDEX)"


@pytest.mark.parametrize("case", ["default", *CI_FILES])
def test_the_trainer_is_a_job_that_ends_as_complete(rendered, case):
    """Not a StatefulSet or Deployment (restart policy Always): an Indexed Job of one pod
    per node whose pods are never restarted in place; a stop by drain or delete (exit 75,
    or the DisruptionTarget condition) does not count against backoffLimit."""
    objects = rendered[case]
    for obj in objects:
        if obj["kind"] in ("StatefulSet", "Deployment"):
            labels = obj["spec"]["template"]["metadata"]["labels"]
            assert labels["app.kubernetes.io/component"] != "trainer", obj["metadata"]["name"]
    job = trainer_job(objects)["spec"]
    args = containers(trainer_job(objects))[0]["args"]
    nodes = int(args[args.index("--nnodes") + 1])
    per_node = int(args[args.index("--nproc-per-node") + 1])
    data = yaml.safe_load(one(objects, "ConfigMap", "flywheel-config")["data"]["flywheel.yaml"])
    assert data["trainer"]["n_ranks"] == nodes * per_node
    assert job["completionMode"] == "Indexed" and job["completions"] == job["parallelism"] == nodes
    assert job["template"]["spec"]["restartPolicy"] == "Never"
    rules = job["podFailurePolicy"]["rules"]
    assert rules[0]["onExitCodes"] == {"containerName": "trainer", "operator": "In", "values": [75]}
    assert rules[1]["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
    assert args[args.index("--stopped-exit-code") + 1] == "75"
    grace = job["template"]["spec"]["terminationGracePeriodSeconds"]
    assert float(args[args.index("--grace") + 1]) == grace - 30


def test_no_model_fails_at_render_or_the_demo_is_prepared(rendered):
    import helm_python as helm

    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmError) as err:
        chart.render({"demo": {"enabled": False}}, name="flywheel", namespace="flywheel")
    assert "config.actor.path is empty" in str(err.value) and "demo.enabled" in str(err.value)
    # default values: the demo, as `flywheel run` with no model and compose's prepare
    objects = rendered["default"]
    [prepare] = [o for o in find(objects, "Job") if "-prepare-" in o["metadata"]["name"]]
    args = containers(prepare)[0]["args"]
    marker = args[args.index("--out") + 1]
    # the run directory of examples/demo.yaml (experiment demo, trial latest) on the volume
    assert marker == "/data/shared/demo/latest/prepared.yaml"
    data = yaml.safe_load(one(objects, "ConfigMap", "flywheel-config")["data"]["flywheel.yaml"])
    assert data["actor"]["path"] == "/data/shared/demo/latest/model/sft"  # warm-started
    assert data["train_dataset"]["path"] == "/data/shared/demo/latest/data/train.jsonl"
    assert data["valid_dataset"]["path"] == "/data/shared/demo/latest/data/valid.jsonl"
    for pod in (trainer_job(objects), one(objects, "StatefulSet", "flywheel-rollout")):
        [wait] = pod["spec"]["template"]["spec"]["initContainers"]
        assert wait["command"][-1] == marker
    # a given model: no prepare Job, nothing waits
    gpu = rendered["gpu-8-values.yaml"]
    assert not [o for o in find(gpu, "Job") if "-prepare-" in o["metadata"]["name"]]
    assert "initContainers" not in trainer_job(gpu)["spec"]["template"]["spec"]


def test_secrets_have_one_value_per_render_and_roll_the_pods(helm_check, rendered):
    objects = rendered["default"]
    sums = {
        o["metadata"]["name"]: o["spec"]["template"]["metadata"]["annotations"]["checksum/secret"]
        for o in workloads(objects)
        if o["metadata"]["labels"]["app.kubernetes.io/component"] != "redis"
    }
    assert len(sums) == 5 and len(set(sums.values())) == 1, sums  # one token in one render
    # given values (or existingSecret): every render is the same, Job names included
    tokens = {"admin": "a0", "trainer": "t0", "rollout": "r0", "launcher": "l0"}
    values = {"auth": {"tokens": tokens}, "redis": {"auth": {"password": "pw"}}}
    a, b = helm_check.render(values), helm_check.render(values)
    assert trainer_job(a)["metadata"]["name"] == trainer_job(b)["metadata"]["name"]
    assert a == b
    changed = helm_check.render({**values, "auth": {"tokens": {**tokens, "trainer": "t1"}}})
    assert trainer_job(changed)["metadata"]["name"] != trainer_job(a)["metadata"]["name"]


@pytest.mark.parametrize("case", ["default", *CI_FILES])
def test_the_chart_leaves_the_peer_outage_budget_alone(rendered, case):
    """A Redis or buffer restart on a cluster takes minutes: the chart's config must not
    shorten the services' time budget for unreachable peers (services.peer_outage_budget_s)
    or the clients' retries."""
    data = yaml.safe_load(
        one(rendered[case], "ConfigMap", "flywheel-config")["data"]["flywheel.yaml"]
    )
    text = yaml.safe_dump(data)
    assert "outage" not in text and "retries" not in text


def test_flywheel_eval_with_the_chart_config_binds_here(helm_check, rendered, tmp_path):
    """`flywheel eval --config <the chart's flywheel.yaml>` starts reward and one rollout
    replica on this machine: on loopback, not on the ConfigMap's Kubernetes DNS names."""
    from services.common.config import load_config
    from services.launcher import assets
    from services.launcher.main import local_eval_endpoints
    from services.reward.__main__ import main as reward_main
    from services.rollout.__main__ import main as rollout_main

    text = one(rendered["gpu-8-values.yaml"], "ConfigMap", "flywheel-config")["data"][
        "flywheel.yaml"
    ]
    (tmp_path / "chart.yaml").write_text(text)
    cfg = load_config(str(tmp_path / "chart.yaml"))
    local_eval_endpoints(cfg)
    assets.assign_ports(cfg)
    resolved = assets.write_resolved_config(cfg, tmp_path)
    assert reward_main(["--check", "--config", str(resolved)]) == 0
    assert rollout_main(["--check", "--eval-only", "--config", str(resolved)]) == 0


@pytest.mark.slow
def test_the_prepare_job_writes_what_the_config_map_names(rendered, tmp_path):
    """The prepare Job's container, run here as its pod would (the ConfigMap's file, its
    own args; the shared volume at a temporary folder): the model and data land exactly at
    the paths the ConfigMap gives every other pod, and the marker the init containers wait
    for is written. (The warm start is cut to 2 steps to keep the test short.)"""
    import subprocess
    import sys

    objects = rendered["default"]
    [prepare] = [o for o in find(objects, "Job") if "-prepare-" in o["metadata"]["name"]]
    text = one(objects, "ConfigMap", "flywheel-config")["data"]["flywheel.yaml"]
    shared = tmp_path / "shared"
    (tmp_path / "flywheel.yaml").write_text(text.replace("/data/shared", str(shared)))
    c = containers(prepare)[0]
    args = [
        a.replace("/etc/flywheel", str(tmp_path)).replace("/data/shared", str(shared))
        for a in c["args"]
    ]
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "deploy" / "docker" / "prepare.py"),
            *args,
            "launcher.warm_start.steps=2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    data = yaml.safe_load(text)
    paths = (data["actor"]["path"], data["tokenizer_path"], data["train_dataset"]["path"])
    for path in (*paths, data["valid_dataset"]["path"]):
        assert Path(path.replace("/data/shared", str(shared))).exists(), path
    marker = args[args.index("--out") + 1]
    assert Path(marker).is_file()


def test_the_trainer_pod_of_a_completed_run_exits_0_at_once(helm_check, tmp_path):
    """The trainer container exactly as the chart renders it (command, args with
    `$(POD_INDEX)` expanded, the ConfigMap's file; the shared volume at a temporary
    folder), started on a run that already reached total_train_steps: it exits 0 before
    loading anything, so its Job index completes instead of training the run again."""
    import os
    import subprocess
    import sys

    from services.common.config import load_config
    from services.trainer.lifecycle import write_completion
    from services.trainer.paths import RunPaths

    objects = helm_check.render({"config": {"total_train_steps": 5}})
    text = one(objects, "ConfigMap", "flywheel-config")["data"]["flywheel.yaml"]
    shared = tmp_path / "shared"
    (tmp_path / "flywheel.yaml").write_text(text.replace("/data/shared", str(shared)))
    cfg = load_config(str(tmp_path / "flywheel.yaml"))
    write_completion(
        RunPaths.from_config(cfg), step=5, version=5, total_train_steps=5, checkpoint=None
    )
    c = containers(trainer_job(objects))[0]
    env = helm_check.container_env(c, "flywheel-trainer-0-x", 0)
    args = [helm_check.expand(a, env).replace("/etc/flywheel", str(tmp_path)) for a in c["args"]]
    assert c["command"][0] == "python"  # the image's interpreter; this venv's here
    result = subprocess.run(
        [sys.executable, *c["command"][1:], *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "run already completed at step 5" in result.stdout + result.stderr


# --- the chart run as Kubernetes runs it: a default install trains ---------------------

OWNED = (
    "cluster",
    "services",
    "buffer.redis_url",
    "trainer.master_addr",
    "trainer.master_port",
    "trainer.weight_dir",
    "trainer.device",
    "actor.path",
    "tokenizer_path",
    "train_dataset.path",
    "valid_dataset.path",
)
"""What the chart derives for the cluster; everything else is the run's configuration."""


def without_owned(data: dict[str, Any]) -> dict[str, Any]:
    data = copy.deepcopy(data)
    for dotted in OWNED:
        *parents, last = dotted.split(".")
        node = data
        for key in parents:
            node = node.get(key) or {}
        node.pop(last, None)
    return data


def test_the_chart_demo_is_examples_demo(helm_check, rendered, tmp_path):
    """Without a model the chart trains examples/demo.yaml, the demo `make run` trains:
    the same algorithm, batch, samples and length, loaded by the services' own loader.
    Before: the embedded defaults (one sample per prompt, batch 1, no total_train_steps)."""
    from services.common.config import load_config

    assert helm_check.demo_is_current(), "run python tools/helm_check.py --write-demo"
    demo = load_config(str(ROOT / "examples" / "demo.yaml"))
    cfg = chart_config(rendered["default"], tmp_path)
    assert without_owned(cfg.model_dump(mode="json")) == without_owned(demo.model_dump(mode="json"))
    assert (cfg.gconfig.n_samples, cfg.rollout.consumer_batch_size) == (8, 64)
    assert cfg.total_train_steps == demo.total_train_steps == 275
    # ci values on top of the demo keep the rest of it (cpu-small: its own run name, eta 2)
    small = chart_config(rendered["cpu-small-values.yaml"], tmp_path)
    assert (small.experiment_name, small.trial_name) == ("demo", "k8s")
    assert small.gconfig.n_samples == 8 and small.actor.optimizer.lr_scheduler_type == "cosine"
    # a user's false, 0 and null win over the demo's values (Sprig's mergeOverwrite would
    # keep the demo's): a synchronous run without the warm start and the held-out set
    values = {
        "config": {
            "rollout": {"max_head_offpolicyness": 0},
            "launcher": {"warm_start": {"enabled": False}},
            "valid_dataset": None,
        }
    }
    sync = chart_config(helm_check.render(values), tmp_path)
    assert sync.rollout.max_head_offpolicyness == 0 and sync.valid_dataset is None
    assert sync.launcher.warm_start.enabled is False
    assert sync.actor.path == "/data/shared/demo/latest/model/base"  # not warm-started


def test_helm_check_finds_a_stale_demo_copy(helm_check, tmp_path, monkeypatch):
    """A value of examples/demo.yaml changed and not copied into the chart is a finding;
    a comment is not."""
    demo = helm_check.DEMO.read_text()
    assert "total_train_steps: 275" in demo
    stale = tmp_path / "demo.yaml"
    monkeypatch.setattr(helm_check, "CHART_DEMO", stale)
    stale.write_text(demo.replace("total_train_steps: 275", "total_train_steps: 274"))
    assert not helm_check.demo_is_current()
    stale.write_text("# the chart's copy\n" + demo)
    assert helm_check.demo_is_current()


def test_a_run_without_a_schedule_length_is_caught_offline(helm_check):
    """Your own model and no total_train_steps: the trainer's default lr schedule (a
    warm-up proportion) cannot be built (PPOTrainer's schedule_steps raises), so the
    trainer pod would exit at start. The preflight builds the schedule and says so, for
    the trainer pod only. Before: every values file passed and the Job failed on the
    cluster."""
    values = {
        "config": {
            "actor": {"path": "/data/shared/models/m"},
            "train_dataset": {"path": "/data/shared/data/train.jsonl"},
        }
    }
    [problem] = helm_check.preflight(helm_check.render(values))
    assert "(trainer)" in problem and "exits 2" in problem
    assert "needs the schedule length: set total_train_steps" in problem
    values["config"]["total_train_steps"] = 100
    assert helm_check.preflight(helm_check.render(values)) == []


def test_a_restarted_rollout_replica_finds_the_published_weights(helm_check, rendered, tmp_path):
    """The trainer publishes under its run directory on the shared volume; a rollout pod
    that restarts mid-run loads the newest version from `trainer.weight_dir` (the rollout
    service's catch-up) before serving. Both paths come from the same ConfigMap, on the
    volume both pods mount. Before: weight_dir unset, the replica found nothing and stayed
    at version 0."""
    import torch

    from services.common.weights.disk import save_weights
    from services.rollout.service import newest_published_weights
    from services.trainer.paths import RunPaths
    from services.trainer.weight_sync import version_dir

    objects = rendered["default"]
    shared = tmp_path / "shared"
    cfg = chart_config(objects, tmp_path, shared)
    published = RunPaths.from_config(cfg).weight_dir  # where the trainer writes
    for version in (2, 3):
        save_weights(version_dir(published, version), {"w": torch.ones(2) * version}, version)
    found = newest_published_weights(cfg.trainer.weight_dir)  # what a restarted replica reads
    assert found is not None and found.resolve() == version_dir(published, 3).resolve()
    assert str(published).startswith(str(shared) + "/")
    for obj in (trainer_job(objects), one(objects, "StatefulSet", "flywheel-rollout")):
        mounts = {m["mountPath"] for m in containers(obj)[0]["volumeMounts"]}
        assert "/data/shared" in mounts, obj["metadata"]["name"]
    # every values file: on the shared volume
    for case, objs in rendered.items():
        data = yaml.safe_load(one(objs, "ConfigMap", "flywheel-config")["data"]["flywheel.yaml"])
        assert data["trainer"]["weight_dir"].startswith("/data/shared/"), case
    import helm_python as helm

    with pytest.raises(helm.HelmError, match="not on the shared volume"):
        helm_check.render({"config": {"trainer": {"weight_dir": "/tmp/weights"}}})


async def test_a_restarted_rollout_pod_serves_the_published_version(rendered, tmp_path):
    """The rollout service built as a restarted pod builds it, from the chart's ConfigMap
    (the shared volume at a temporary folder, the demo's model where the prepare Job puts
    it): the trainer published versions 2 and 3 under its run directory (RunPaths, the
    publisher's `v<version>` folders, other weights than the model's), and before serving
    the replica loads version 3 and its weights (`RolloutService.catch_up`)."""
    import torch
    from safetensors.torch import load_file

    from services.common.tiny_model import write_tiny_model
    from services.common.weights.disk import save_weights
    from services.rollout.service import RolloutService
    from services.trainer.paths import RunPaths
    from services.trainer.weight_sync import version_dir

    shared = tmp_path / "shared"
    cfg = chart_config(rendered["default"], tmp_path, shared)
    write_tiny_model(Path(cfg.actor.path))
    other = write_tiny_model(tmp_path / "other", seed=1)  # the trained weights
    trained = {}
    for f in sorted(other.glob("*.safetensors")):
        trained.update(load_file(str(f)))
    published = RunPaths.from_config(cfg).weight_dir
    for version in (2, 3):
        save_weights(version_dir(published, version), trained, version)
    replica = RolloutService(cfg, replica_index=0)
    await replica.engine.start()
    try:
        assert replica.engine.version == 0
        assert await replica.catch_up()
        assert replica.engine.version == 3
        served = dict(replica.engine.model.named_parameters())
        name = next(n for n in trained if n in served and trained[n].is_floating_point())
        torch.testing.assert_close(served[name].detach().cpu(), trained[name], rtol=0, atol=0)
    finally:
        await replica.engine.stop()


def test_config_cannot_override_what_the_chart_owns(helm_check, tmp_path):
    """A `config` that sets an owned key (ranks, replicas, addresses, the file root) to
    another value than the chart derives is refused at render time, naming the chart value
    to set; the same value is accepted. Before: examples/demo.yaml as `config` rendered,
    and its pods ran with `cluster.fileroot: runs` on a read-only root file system."""
    import helm_python as helm

    demo = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    with pytest.raises(helm.HelmError) as err:
        helm_check.render({"config": demo})
    assert "config.cluster.fileroot=runs" in str(err.value)
    assert "sharedStorage.mountPath" in str(err.value)
    del demo["cluster"]
    with pytest.raises(helm.HelmError) as err:  # demo.yaml says n_ranks 1, the pods hold 2
        helm_check.render({"config": demo, "trainer": {"nprocPerNode": 2}})
    assert "config.trainer.n_ranks=1" in str(err.value)
    assert "trainer.nodes x trainer.nprocPerNode" in str(err.value)
    for bad, hint in (
        ({"services": {"buffer": {"port": 6000}}}, "<service>.ports.grpc"),
        ({"rollout": {"n_replicas": 3}}, "rollout.replicaCount"),
        ({"trainer": {"master_port": 1234}}, "trainer.rendezvousPort"),
        ({"services": {"rollout": {"port_stride": 1}}}, "every rollout replica is its own pod"),
    ):
        with pytest.raises(helm.HelmError, match="the chart sets it to") as err:
            helm_check.render({"config": bad})
        assert hint in str(err.value), bad
    # every owned key is refused with a message that names what to set instead
    owned = [
        "cluster.fileroot", "buffer.redis_url", "rollout.n_replicas", "trainer.n_ranks",
        "trainer.backend", "trainer.weight_transport", "trainer.master_addr",
        "trainer.master_port",
    ] + [
        f"services.{c}.{f}"
        for c in ("buffer", "reward", "rollout", "trainer")
        for f in ("host", "port", "metrics_port")
    ] + ["services.rollout.port_stride"]  # fmt: skip
    sglang = helm_check.load_values(CHART / "ci" / "gpu-8-values.yaml")
    for dotted in [*owned, "rollout.engine", "rollout.sglang.url"]:
        config: dict[str, Any] = {}
        node = config
        *parents, last = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = 7
        values = {"config": config}
        if dotted.startswith("rollout.sglang") or dotted == "rollout.engine":
            values = {**sglang, "config": {**sglang["config"], **config}}
            values["config"]["rollout"] = {**sglang["config"]["rollout"], **config["rollout"]}
        with pytest.raises(helm.HelmError) as err:
            helm_check.render(values)
        message = str(err.value)
        assert f"config.{dotted}=7: the chart sets it to" in message, dotted
        assert "; set " in message and "%!" not in message and "<nil>" not in message, message
    # the same values as the chart's are fine, and the run trains: every pod would start
    objects = helm_check.render({"config": demo, "trainer": {"nprocPerNode": 1}})
    assert helm_check.preflight(objects) == []
    cfg = chart_config(objects, tmp_path)
    assert cfg.trainer.n_ranks == 1 and cfg.cluster.fileroot == "/data/shared"


def test_a_values_change_outside_the_topology_rolls_no_service_pod(helm_check):
    """Changing the dashboards' folder changes neither the ConfigMap nor any pod template
    (nothing for Kubernetes to roll): the buffer, reward and rollout pods stay, and so does
    the trainer Job (named by the hash of its own spec). Changing the trainer's resources
    replaces the trainer Job only; the ConfigMap still names no Job, and the rank-0 Service
    follows the new one. Before: the ConfigMap named the Job, whose name hashed every value,
    so any change rolled every pod."""
    tokens = {"admin": "a0", "trainer": "t0", "rollout": "r0", "launcher": "l0"}
    values = {"auth": {"tokens": tokens}, "redis": {"auth": {"password": "pw"}}}
    a = helm_check.render(values)
    b = helm_check.render({**values, "dashboards": {"folder": "RL"}})
    resources = {"requests": {"cpu": "3", "memory": "8Gi"}, "limits": {"memory": "32Gi"}}
    c = helm_check.render({**values, "trainer": {"resources": resources}})
    config = one(a, "ConfigMap", "flywheel-config")
    for other in (b, c):
        assert one(other, "ConfigMap", "flywheel-config") == config
        for kind, name in (
            ("Deployment", "flywheel-buffer"),
            ("Deployment", "flywheel-reward"),
            ("StatefulSet", "flywheel-rollout"),
        ):
            assert one(a, kind, name)["spec"] == one(other, kind, name)["spec"], name
    job_a, job_b, job_c = trainer_job(a), trainer_job(b), trainer_job(c)
    assert job_a == job_b
    assert job_c["metadata"]["name"] != job_a["metadata"]["name"]
    assert job_a["metadata"]["name"] not in config["data"]["flywheel.yaml"]
    assert selects(one(c, "Service", "flywheel-trainer-0"), kubernetes_pod_labels(job_c, 0))
    assert not selects(one(c, "Service", "flywheel-trainer-0"), kubernetes_pod_labels(job_a, 0))


# --- security ------------------------------------------------------------------


def _selector(component: str) -> dict[str, Any]:
    return {
        "podSelector": {
            "matchLabels": {
                "app.kubernetes.io/name": "flywheel",
                "app.kubernetes.io/instance": "flywheel",
                "app.kubernetes.io/component": component,
            }
        }
    }


def _policies(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        o["metadata"]["name"].removeprefix("flywheel-"): o["spec"]
        for o in find(objects, "NetworkPolicy")
    }


def _reaches(spec: dict[str, Any]) -> set[tuple[str, Any]]:
    """(component, port or 'any') of every egress rule to a pod of the release."""
    out = set()
    for rule in spec["egress"]:
        for peer in rule.get("to") or []:
            component = (
                peer.get("podSelector", {})
                .get("matchLabels", {})
                .get("app.kubernetes.io/component")
            )
            if component and "namespaceSelector" not in peer:
                ports = [p["port"] for p in rule.get("ports") or []] or ["any"]
                out |= {(component, p) for p in ports}
    return out


def test_network_policies_ingress_and_egress_per_component(rendered):
    """Redis <- buffer; buffer <- rollout, trainer; reward <- rollout; rollout <- trainer;
    metrics <- the monitoring namespace; egress only to those peers and DNS (reward: DNS
    only, Redis: nothing). Before: ingress from any pod of the release, no egress rules."""
    policies = _policies(rendered["default"])
    assert sorted(policies) == ["buffer", "redis", "reward", "rollout", "trainer"]
    for spec in policies.values():
        assert spec["policyTypes"] == ["Ingress", "Egress"]
    ingress_from = {
        name: {
            (peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"],
             tuple(p["port"] for p in rule.get("ports") or []) or "any")
            for rule in spec["ingress"]
            for peer in rule.get("from") or []
            if "podSelector" in peer and "namespaceSelector" not in peer
        }
        for name, spec in policies.items()
    }  # fmt: skip
    assert ingress_from == {
        "redis": {("buffer", (6379,))},
        "buffer": {("rollout", (50051,)), ("trainer", (50051,))},
        "reward": {("rollout", (50051,))},
        "rollout": {("trainer", (50051,))},
        "trainer": {("trainer", "any")},
    }
    assert {n: _reaches(s) for n, s in policies.items()} == {
        "redis": set(),
        "buffer": {("redis", 6379)},
        "reward": set(),
        "rollout": {("buffer", 50051), ("reward", 50051)},
        "trainer": {("buffer", 50051), ("rollout", 50051), ("trainer", "any")},
    }
    assert policies["redis"]["egress"] == []
    monitoring = [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    for name, spec in policies.items():
        if name == "redis":
            continue
        [metrics] = [
            r for r in spec["ingress"] if r.get("ports") == [{"port": 9400, "protocol": "TCP"}]
        ]
        assert metrics["from"] == monitoring, name
        # everything a component may reach besides its peers is DNS in kube-system
        others = [
            r
            for r in spec["egress"]
            if not any(
                "podSelector" in p and "namespaceSelector" not in p for p in r.get("to") or []
            )
        ]
        assert others == [
            {
                "ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}],
                "to": [
                    {
                        "namespaceSelector": {
                            "matchLabels": {"kubernetes.io/metadata.name": "kube-system"}
                        },
                        "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
                    }
                ],
            }
        ], name
    # the scrapers' selector is a value (ci/tls-values.yaml: a `prometheus` namespace)
    tls = _policies(rendered["tls-values.yaml"])
    assert tls["buffer"]["ingress"][-1]["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "prometheus"
    }
    # distributed weights (gpu-8): NCCL between trainer and replicas on any port, both ways
    gpu = _policies(rendered["gpu-8-values.yaml"])
    assert ("trainer", "any") in _reaches(gpu["rollout"])
    assert ("rollout", "any") in _reaches(gpu["trainer"])
    assert ("trainer", "any") not in _reaches(policies["rollout"])
    assert ("rollout", "any") not in _reaches(gpu["rollout"])  # flat: replicas never dial


def test_two_level_fanout_lets_replicas_reach_each_other(helm_check):
    """With `trainer.weight_fanout: two_level` a relay replica re-broadcasts each bucket to
    its node's replicas (services/trainer/fanout.py): rollout pods reach rollout pods on any
    port, both ways; nothing else opens, and the flat fan-out keeps them apart. (The torch
    engine of the default values: SGLang servers cannot relay, and the config refuses it.)"""
    flat_values = {"trainer": {"weightTransport": "distributed"}, "rollout": {"replicaCount": 4}}
    two_level_values = {
        **flat_values,
        "config": {"trainer": {"weight_fanout": "two_level", "weight_fanout_replicas_per_node": 2}},
    }
    objects = helm_check.render(two_level_values)
    assert helm_check.validate_objects(objects) == []
    two_level, flat = _policies(objects), _policies(helm_check.render(flat_values))
    assert ("rollout", "any") in _reaches(two_level["rollout"])
    assert ("rollout", "any") not in _reaches(flat["rollout"])
    sources = [
        peer["podSelector"]["matchLabels"].get("app.kubernetes.io/component")
        for rule in two_level["rollout"]["ingress"]
        for peer in rule.get("from") or []
        if "podSelector" in peer and not rule.get("ports")
    ]
    assert sorted(sources) == ["rollout", "trainer"]  # any port: the trainer and the relays
    for name in ("redis", "buffer", "reward", "trainer"):
        assert two_level[name] == flat[name], name
    assert len(two_level["rollout"]["ingress"]) == len(flat["rollout"]["ingress"]) + 1
    assert len(two_level["rollout"]["egress"]) == len(flat["rollout"]["egress"]) + 1
    config = yaml.safe_load(one(objects, "ConfigMap", "flywheel-config")["data"]["flywheel.yaml"])
    assert config["trainer"]["weight_fanout"] == "two_level"


def test_network_policy_options(helm_check):
    judge = {"to": [{"ipBlock": {"cidr": "10.9.0.0/16"}}], "ports": [{"port": 443}]}
    objects = helm_check.render({"networkPolicy": {"extraEgress": {"reward": [judge]}}})
    assert helm_check.validate_objects(objects) == []
    assert _policies(objects)["reward"]["egress"][-1] == judge
    external = helm_check.render(
        helm_check.load_values(CHART / "ci" / "external-redis-values.yaml")
    )
    policies = _policies(external)
    assert "redis" not in policies
    url = yaml.safe_load(one(external, "ConfigMap", "flywheel-config")["data"]["flywheel.yaml"])[
        "buffer"
    ]["redis_url"]
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    assert policies["buffer"]["egress"][0] == {"ports": [{"port": port, "protocol": "TCP"}]}


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {
        e["name"]: e.get("valueFrom", {}).get("secretKeyRef", e.get("value"))
        for e in container.get("env") or []
    }


def test_tls_off_and_on(helm_check, rendered):
    """Off (default): plaintext, native gRPC probes. On (ci/tls-values.yaml): a cert-manager
    Certificate naming every address in the ConfigMap, its Secret mounted read-only in every
    Flywheel container, services.tls set through FLYWHEEL_TLS_*, mTLS, HTTP probes (the
    kubelet's gRPC probe cannot speak TLS)."""
    import fnmatch

    off = rendered["default"]
    assert not find(off, "Certificate")
    for obj in workloads(off):
        for c in containers(obj):
            assert not any(k.startswith("FLYWHEEL_TLS") for k in _env(c)), obj["metadata"]["name"]
    on = rendered["tls-values.yaml"]
    cert = one(on, "Certificate", "flywheel-tls")["spec"]
    assert cert["secretName"] == "flywheel-tls" and cert["issuerRef"]["name"] == "flywheel-ca"
    assert {"server auth", "client auth"} <= set(cert["usages"])
    cfg = yaml.safe_load(one(on, "ConfigMap", "flywheel-config")["data"]["flywheel.yaml"])
    hosts = [
        cfg["services"][c]["host"].replace("{i}", "0")
        for c in ("buffer", "reward", "rollout", "trainer")
    ]
    for host in hosts:
        assert any(
            fnmatch.fnmatch(host, n) and host.count(".") == n.count(".") for n in cert["dnsNames"]
        ), host
    seen = 0
    for obj in workloads(on):
        pod = obj["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        for c in pod["containers"]:
            if c["name"] not in ("buffer", "reward", "rollout", "trainer"):
                continue
            seen += 1
            env = _env(c)
            assert env["FLYWHEEL_TLS_CERT"] == "/etc/flywheel-tls/tls.crt"
            assert env["FLYWHEEL_TLS_KEY"] == "/etc/flywheel-tls/tls.key"
            assert env["FLYWHEEL_TLS_CA"] == "/etc/flywheel-tls/ca.crt"
            assert env["FLYWHEEL_TLS_REQUIRE_CLIENT_CERT"] == "1"
            [mount] = [m for m in c["volumeMounts"] if m["name"] == "tls"]
            assert mount == {"name": "tls", "mountPath": "/etc/flywheel-tls", "readOnly": True}
            assert volumes["tls"]["secret"]["secretName"] == "flywheel-tls"
            assert (
                "grpc" not in c["startupProbe"]
                and c["readinessProbe"]["httpGet"]["path"] == "/readyz"
            )
    assert seen == 4
    # the services' own config loader takes these settings: TLS and mTLS on
    from services.common.config.services import TLSConfig

    trainer_env = _env(containers(trainer_job(on))[0])
    tls = TLSConfig(
        cert_file=trainer_env["FLYWHEEL_TLS_CERT"],
        key_file=trainer_env["FLYWHEEL_TLS_KEY"],
        ca_file=trainer_env["FLYWHEEL_TLS_CA"],
        require_client_cert=True,
    )
    assert tls.enabled and tls.client_enabled
    # an existing Secret instead of cert-manager; TLS without either fails at render
    own = helm_check.render({"tls": {"enabled": True, "existingSecret": "my-certs"}})
    assert not find(own, "Certificate") and helm_check.validate_objects(own) == []
    buffer = one(own, "Deployment", "flywheel-buffer")["spec"]["template"]["spec"]
    assert {v["name"]: v for v in buffer["volumes"]}["tls"]["secret"]["secretName"] == "my-certs"
    import helm_python as helm

    with pytest.raises(helm.HelmError, match="tls.existingSecret"):
        helm_check.render({"tls": {"enabled": True}})


def test_each_pod_gets_only_its_own_roles_token(helm_check, rendered):
    """One token per role in the Secret and their sha256 digests as `credentials`; every
    server gets the digests, rollout and trainer pods their own role's token, buffer and
    reward none; the Redis password only in the buffer and Redis. Before: one shared token
    in every pod."""
    import base64
    import hashlib

    from services.common.config.services import ROLES, ServicesConfig

    objects = rendered["default"]
    data = {
        k: base64.b64decode(v).decode()
        for k, v in one(objects, "Secret", "flywheel-token")["data"].items()
    }
    assert set(data) == {*ROLES, "credentials"}
    assert len({data[r] for r in ROLES}) == len(ROLES)  # four different tokens
    digests = dict(p.split("=", 1) for p in data["credentials"].split(","))
    assert digests == {r: "sha256:" + hashlib.sha256(data[r].encode()).hexdigest() for r in ROLES}
    ServicesConfig(credentials=digests)  # the services' loader accepts it
    expected_token = {"buffer": None, "reward": None, "rollout": "rollout", "trainer": "trainer"}
    for obj in workloads(objects):
        for c in containers(obj) + obj["spec"]["template"]["spec"].get("initContainers", []):
            env = _env(c)
            refs = [v for v in env.values() if isinstance(v, dict)]
            if c["name"] in expected_token:
                assert env["FLYWHEEL_CREDENTIALS"] == {
                    "name": "flywheel-token",
                    "key": "credentials",
                }
                role = expected_token[c["name"]]
                token = env.get("FLYWHEEL_TOKEN")
                assert token == ({"name": "flywheel-token", "key": role} if role else None), c[
                    "name"
                ]
            keys = {r["key"] for r in refs if r["name"] == "flywheel-token"}
            assert keys <= {"credentials", expected_token.get(c["name"])}, (c["name"], keys)
            has_redis = any(r["name"] == "flywheel-redis" for r in refs)
            assert has_redis == (c["name"] in ("buffer", "redis")), c["name"]
    # the shared token, when asked for, is what every pod gets
    shared = helm_check.render({"auth": {"perService": False}})
    assert set(one(shared, "Secret", "flywheel-token")["data"]) == {"token"}
    for obj in workloads(shared):
        for c in containers(obj):
            if c["name"] in expected_token:
                assert _env(c)["FLYWHEEL_TOKEN"] == {"name": "flywheel-token", "key": "token"}
    assert helm_check.preflight(shared) == []


def test_redis_runs_unprivileged(rendered):
    redis = one(rendered["default"], "StatefulSet", "flywheel-redis")["spec"]["template"]["spec"]
    assert redis["securityContext"]["runAsNonRoot"] is True
    assert redis["securityContext"]["runAsUser"] == 999
    assert redis["automountServiceAccountToken"] is False
    [c] = redis["containers"]
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert "requirepass" not in " ".join(c["command"][:2])  # the password is not in argv


def test_sglang_requires_an_api_key(helm_check, rendered):
    """gpu-8 renders SGLang beside each replica: started with --api-key from a Secret (the
    kubelet expands it; never in the ConfigMap), the rollout container holds the same key."""
    objects = rendered["gpu-8-values.yaml"]
    pod = one(objects, "StatefulSet", "flywheel-rollout")["spec"]["template"]["spec"]
    by_name = {c["name"]: c for c in pod["containers"]}
    args = by_name["sglang"]["args"]
    assert args[args.index("--api-key") + 1] == "$(SGLANG_API_KEY)"
    ref = {"name": "flywheel-sglang", "key": "api-key"}
    assert _env(by_name["sglang"])["SGLANG_API_KEY"] == ref
    assert _env(by_name["rollout"])["SGLANG_API_KEY"] == ref
    key = one(objects, "Secret", "flywheel-sglang")["data"]["api-key"]
    assert key and key not in one(objects, "ConfigMap", "flywheel-config")["data"]["flywheel.yaml"]
    values = helm_check.load_values(CHART / "ci" / "gpu-8-values.yaml")
    values["rollout"]["sglang"]["apiKey"] = {"enabled": False}
    plain = one(helm_check.render(values), "StatefulSet", "flywheel-rollout")
    assert "--api-key" not in containers(plain)[1]["args"]
