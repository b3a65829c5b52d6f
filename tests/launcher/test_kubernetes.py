"""The Kubernetes scheduler: its manifests validate like the chart's, and its create / wait
/ follow-logs / delete cycle runs through the real `kubernetes` client against a stand-in
API server on loopback (no cluster can exist on this machine; the stand-in implements
only the REST calls the launcher makes, and plays the controllers: pods become ready,
the trainer container exits)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
import yaml

from services.common.config import FlywheelConfig, load_config
from services.launcher import kubernetes as k8s

ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = [
    "scheduler.type=kubernetes",
    "scheduler.namespace=fw-test",
    "scheduler.release_name=demo",
    "scheduler.image=ghcr.io/flywheel-rl/flywheel-cpu:0.1.0",
    "actor.path=/data/shared/models/tiny",
    "train_dataset.path=/data/shared/data/train.jsonl",
    "rollout.n_replicas=2",
    "trainer.n_ranks=2",
    "launcher.startup_timeout=30",
]


def load_helm_check():
    spec = importlib.util.spec_from_file_location(
        "helm_check_k8s", ROOT / "tools" / "helm_check.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def helm_check():
    return load_helm_check()


@pytest.fixture
def cfg() -> FlywheelConfig:
    return load_config(str(ROOT / "examples" / "grpo.yaml"), OVERRIDES)


def by_kind_name(objects):
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


# --- manifests -------------------------------------------------------------------------------


def test_manifests_validate_strictly(cfg, helm_check):
    objects = k8s.build_manifests(cfg)
    assert helm_check.validate_objects(objects) == []
    kinds = [o["kind"] for o in objects]
    assert kinds[:3] == ["Namespace", "Secret", "ConfigMap"]
    assert kinds.count("StatefulSet") == 2 and kinds.count("Deployment") == 2
    assert kinds.count("Job") == 1  # the trainer: Complete after total_train_steps


def test_same_topology_and_names_as_the_chart(cfg, helm_check):
    ours = by_kind_name(k8s.build_manifests(cfg))
    chart = by_kind_name(helm_check.render({}, name="demo", namespace="fw-test"))
    kinds = ("Deployment", "StatefulSet")
    workloads = {key for key in ours if key[0] in kinds}
    assert workloads == {key for key in chart if key[0] in kinds}
    assert workloads == {
        ("StatefulSet", "demo-flywheel-redis"),
        ("Deployment", "demo-flywheel-buffer"),
        ("Deployment", "demo-flywheel-reward"),
        ("StatefulSet", "demo-flywheel-rollout"),
    }
    # the trainer is a Job in both; the chart's name carries its revision hash
    [chart_job] = [v for k, v in chart.items() if k[0] == "Job" and "-trainer-" in k[1]]
    ours_job = ours[("Job", "demo-flywheel-trainer")]
    assert chart_job["spec"]["completionMode"] == ours_job["spec"]["completionMode"] == "Indexed"
    for key in [k for k in ours if k[0] == "Service"]:
        assert key in chart, key
    pairs = [
        (
            ours[("StatefulSet", "demo-flywheel-rollout")],
            chart[("StatefulSet", "demo-flywheel-rollout")],
        )
    ]
    for ours_obj, chart_obj in [*pairs, (ours_job, chart_job)]:
        a = ours_obj["spec"]["template"]["spec"]["containers"][0]
        b = chart_obj["spec"]["template"]["spec"]["containers"][0]
        assert a["command"] == b["command"]
        assert a["startupProbe"]["grpc"] == b["startupProbe"]["grpc"]
        assert a["readinessProbe"]["grpc"] == b["readinessProbe"]["grpc"]
        assert a["livenessProbe"]["httpGet"] == b["livenessProbe"]["httpGet"]


def test_network_policies_are_the_charts(cfg, helm_check):
    """The launcher's policies are built from the same table as the chart's (issue 24): the
    chart's files/network.yaml equals `NETWORK`, and every policy, ingress and egress, is
    the one the chart renders for the same release, with disk and with distributed weights
    (NCCL between trainer and replicas opens the rollout <-> trainer rules to any port)."""
    table = yaml.safe_load((ROOT / "deploy/helm/flywheel/files/network.yaml").read_text())
    assert table == k8s.NETWORK
    for transport in ("disk", "distributed"):
        run_cfg = cfg.model_copy(deep=True)
        run_cfg.trainer.weight_transport = transport
        ours = {
            o["metadata"]["name"]: o["spec"]
            for o in k8s.build_manifests(run_cfg)
            if o["kind"] == "NetworkPolicy"
        }
        chart = {
            o["metadata"]["name"]: o["spec"]
            for o in helm_check.render(
                {"trainer": {"weightTransport": transport}}, name="demo", namespace="fw-test"
            )
            if o["kind"] == "NetworkPolicy"
        }
        assert sorted(ours) == [f"demo-flywheel-{c}" for c in sorted(k8s.NETWORK)]
        assert ours == chart, transport
    # created before any workload, so that no pod runs unconfined
    kinds = [o["kind"] for o in k8s.build_manifests(cfg)]
    first_workload = min(kinds.index(k) for k in ("Deployment", "StatefulSet", "Job"))
    assert max(i for i, k in enumerate(kinds) if k == "NetworkPolicy") < first_workload


def test_network_policies_with_an_external_redis(cfg):
    run_cfg = cfg.model_copy(deep=True)
    run_cfg.buffer.redis_url = "redis://redis.example:6380/0"
    policies = {
        o["metadata"]["name"]: o["spec"]
        for o in k8s.build_manifests(run_cfg, redis_password="pw")
        if o["kind"] == "NetworkPolicy"
    }
    assert "demo-flywheel-redis" not in policies
    egress = policies["demo-flywheel-buffer"]["egress"]
    assert egress[0] == {"ports": [{"port": 6380, "protocol": "TCP"}]}  # wherever it lives
    assert [r["ports"][0]["port"] for r in egress] == [6380, 53]


def test_config_map_is_a_loadable_cluster_config_without_secrets(cfg):
    objects = by_kind_name(k8s.build_manifests(cfg, token="tok-123", redis_password="pw-456"))
    text = objects[("ConfigMap", "demo-flywheel-config")]["data"]["flywheel.yaml"]
    assert "tok-123" not in text and "pw-456" not in text
    loaded = FlywheelConfig.model_validate(yaml.safe_load(text))
    assert loaded.services.buffer.address == "demo-flywheel-buffer.fw-test.svc:50051"
    assert (
        loaded.services.rollout.replica_address(1)
        == "demo-flywheel-rollout-1.demo-flywheel-rollout-headless.fw-test.svc:50051"
    )
    assert loaded.buffer.redis_url == "redis://demo-flywheel-redis.fw-test.svc:6379/0"
    assert loaded.services.auth_token is None or loaded.services.auth_token != "tok-123"
    secret = objects[("Secret", "demo-flywheel-secrets")]["stringData"]
    assert secret["admin"] == "tok-123" and secret["redis-password"] == "pw-456"
    assert set(secret) == {
        "admin",
        "trainer",
        "rollout",
        "launcher",
        "credentials",
        "redis-password",
    }
    job = objects[("Job", "demo-flywheel-trainer")]["spec"]
    trainer = job["template"]["spec"]["containers"][0]
    assert trainer["command"] == ["python", "-m", "services.trainer"]
    assert trainer["args"][trainer["args"].index("--nproc-per-node") + 1] == "2"
    assert trainer["args"][-1] == "services.trainer.host=0.0.0.0"
    assert job["template"]["spec"]["restartPolicy"] == "Never"
    # what the trainer pod loads: the ConfigMap plus its own args, as the kubelet expands them
    assert (
        loaded.trainer.master_addr
        == "demo-flywheel-trainer-0.demo-flywheel-trainer-headless.fw-test.svc"
    )
    assert objects[("StatefulSet", "demo-flywheel-rollout")]["spec"]["replicas"] == 2


def test_each_pod_gets_only_its_own_roles_token(cfg):
    """As the chart (issue 24): a token per role in the Secret, the servers only their
    digests (`FLYWHEEL_CREDENTIALS`), rollout and trainer pods their own role's token, buffer
    and reward none, the Redis password only the buffer and Redis; credentials and TLS
    paths of the launching machine never reach the ConfigMap. Before: one shared token in
    every pod."""
    import hashlib

    from services.common.config.services import ServicesConfig

    run_cfg = cfg.model_copy(deep=True)
    run_cfg.services.credentials = {"trainer": "tr-tok", "rollout": "ro-tok"}
    run_cfg.services.tls.ca_file = "/home/me/ca.crt"
    run_cfg.scheduler.tls_secret = "flywheel-tls"
    objects = by_kind_name(k8s.build_manifests(run_cfg))
    secret = objects[("Secret", "demo-flywheel-secrets")]["stringData"]
    assert secret["trainer"] == "tr-tok" and secret["rollout"] == "ro-tok"
    digests = dict(p.split("=", 1) for p in secret["credentials"].split(","))
    assert digests["rollout"] == "sha256:" + hashlib.sha256(b"ro-tok").hexdigest()
    assert set(digests) == {"admin", "trainer", "rollout", "launcher"}
    ServicesConfig(credentials=digests)
    text = objects[("ConfigMap", "demo-flywheel-config")]["data"]["flywheel.yaml"]
    assert "tr-tok" not in text and "/home/me" not in text and "credentials" not in text
    expected = {"buffer": None, "reward": None, "rollout": "rollout", "trainer": "trainer"}
    seen = set()
    for (kind, _), obj in objects.items():
        if kind not in ("Deployment", "StatefulSet", "Job"):
            continue
        for c in obj["spec"]["template"]["spec"]["containers"]:
            refs = {
                e["name"]: e["valueFrom"]["secretKeyRef"]["key"]
                for e in c.get("env") or []
                if "secretKeyRef" in e.get("valueFrom", {})
            }
            if c["name"] in expected:
                seen.add(c["name"])
                assert refs.get("FLYWHEEL_CREDENTIALS") == "credentials"
                assert refs.get("FLYWHEEL_TOKEN") == expected[c["name"]], c["name"]
            has_redis = "redis-password" in refs.values()
            assert has_redis == (c["name"] in ("buffer", "redis")), c["name"]
    assert seen == set(expected)
    run_cfg.services.credentials = {"rollout": "sha256:" + "0" * 64}
    with pytest.raises(k8s.KubernetesLaunchError, match="rollout pods need the token"):
        k8s.build_manifests(run_cfg)


def test_every_pod_loads_the_config_map_with_its_own_args(cfg, tmp_path):
    """Each container's config as its pod loads it: the ConfigMap's file plus the args
    (`services.<name>.host=0.0.0.0`). With 2 rollout replicas on one port this used to
    fail the port check (both replicas "on 0.0.0.0:50051")."""
    objects = by_kind_name(k8s.build_manifests(cfg))
    path = tmp_path / "flywheel.yaml"
    path.write_text(objects[("ConfigMap", "demo-flywheel-config")]["data"]["flywheel.yaml"])
    for (kind, name), obj in objects.items():
        if kind not in ("Deployment", "StatefulSet", "Job") or name.endswith("redis"):
            continue
        args = obj["spec"]["template"]["spec"]["containers"][0]["args"]
        overrides = [a for a in args if "=" in a and not a.startswith("-")]
        loaded = load_config(str(path), overrides)
        assert loaded.rollout.n_replicas == 2, name
        component = name.rsplit("-", 1)[-1]
        assert getattr(loaded.services, component).host == "0.0.0.0", name


def test_external_redis_and_gpu_engine(helm_check):
    cfg = load_config(
        str(ROOT / "examples" / "grpo.yaml"),
        [
            *OVERRIDES,
            "buffer.redis_url=redis://redis.data:6379/0",
            "rollout.engine=sglang",
            "trainer.backend=nccl",
            "trainer.device=cuda",
            "+scheduler.node_selector.gpu=h100",
        ],
    )
    objects = k8s.build_manifests(cfg)
    assert helm_check.validate_objects(objects) == []
    keyed = by_kind_name(objects)
    assert ("StatefulSet", "demo-flywheel-redis") not in keyed
    assert "redis-password" not in keyed[("Secret", "demo-flywheel-secrets")]["stringData"]
    rollout = keyed[("StatefulSet", "demo-flywheel-rollout")]["spec"]["template"]["spec"]
    sglang = {c["name"]: c for c in rollout["containers"]}["sglang"]
    assert sglang["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert rollout["nodeSelector"] == {"gpu": "h100"}
    data = yaml.safe_load(keyed[("ConfigMap", "demo-flywheel-config")]["data"]["flywheel.yaml"])
    assert data["rollout"]["sglang"]["url"] == "http://127.0.0.1:30000"
    trainer = keyed[("Job", "demo-flywheel-trainer")]["spec"]["template"]["spec"]["containers"][0]
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == 2


def test_a_run_without_a_model_on_the_volume_is_refused(capsys):
    cfg = load_config(str(ROOT / "examples" / "grpo.yaml"), ["scheduler.type=kubernetes"])
    assert k8s.run(cfg, dry_run_dir="/nonexistent") == 2
    assert "actor.path is empty" in capsys.readouterr().err


def test_dry_run_writes_the_manifests_in_order(tmp_path, helm_check):
    out = tmp_path / "manifests"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.launcher.kubernetes",
            "--config",
            str(ROOT / "examples" / "grpo.yaml"),
            "--dry-run",
            str(out),
            *OVERRIDES,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    files = sorted(out.iterdir())
    # 14 objects and a NetworkPolicy for each of the five components
    assert len(files) == 19 and files[0].name == "00-namespace-fw-test.yaml"
    objects = [yaml.safe_load(p.read_text()) for p in files]
    assert helm_check.validate_objects(objects) == []
    assert [o["kind"] for o in objects][-1] == "Job"


# --- the stand-in API server -------------------------------------------------------------------


class StandInCluster:
    """Stores what the client creates, answers reads, plays the controllers."""

    def __init__(
        self, trainer_exit: int = 0, fail_pull: str | None = None, namespace_exists: bool = False
    ):
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.log: list[tuple[str, str]] = []
        self.trainer_exit = trainer_exit
        self.fail_pull = fail_pull
        self.pod_list_calls = 0
        self.lock = threading.Lock()
        if namespace_exists:
            self.objects[("namespaces", "fw-test")] = {"metadata": {"name": "fw-test"}}

    # route: (group path, resource, name, subresource)
    PATH = re.compile(
        r"^/(?:api/v1|apis/apps/v1|apis/batch/v1|apis/networking\.k8s\.io/v1)(?:/namespaces/(?P<ns>[^/]+))?/(?P<res>[a-z]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[a-z]+))?$"
    )
    ROOT_NS = re.compile(r"^/api/v1/namespaces(?:/(?P<name>[^/]+))?$")

    def route(self, method: str, url: str, body: dict | None) -> tuple[int, Any]:
        parsed = urlparse(url)
        with self.lock:
            self.log.append((method, parsed.path))
            m = self.ROOT_NS.match(parsed.path)
            if m:
                res, name, sub = "namespaces", m.group("name"), None
            else:
                m = self.PATH.match(parsed.path)
                if not m:
                    return 404, {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "status": "Failure",
                        "code": 404,
                    }
                res, name, sub = m.group("res"), m.group("name"), m.group("sub")
            if method == "POST":
                key = (res, body["metadata"]["name"])
                if key in self.objects:
                    return 409, {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "status": "Failure",
                        "reason": "AlreadyExists",
                        "code": 409,
                    }
                self.objects[key] = body
                return 201, body
            if method == "DELETE":
                gone = self.objects.pop((res, name), None)
                if gone is None:
                    return 404, {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "status": "Failure",
                        "code": 404,
                    }
                # as the real API: a deleted Service or claim comes back as itself
                if res in ("services", "persistentvolumeclaims"):
                    return 200, gone
                return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}
            if res == "pods" and name is None:
                self.pod_list_calls += 1
                return 200, self.pods()
            if res == "pods" and sub == "log":
                container = parse_qs(parsed.query)["container"][0]
                return 200, f"starting {container}\n{container} serving on {name}\n"
            if sub == "status":
                obj = self.objects[(res, name)]
                want = obj["spec"].get("replicas", 1)
                return 200, {**obj, "status": {"replicas": want, "readyReplicas": want}}
            return 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404}

    def pods(self) -> dict[str, Any]:
        items = []
        for (res, name), obj in self.objects.items():
            if res not in ("deployments", "statefulsets", "jobs"):
                continue
            for i in range(obj["spec"].get("replicas", obj["spec"].get("parallelism", 1))):
                statuses = []
                for c in obj["spec"]["template"]["spec"]["containers"]:
                    state: dict[str, Any] = {"running": {}}
                    if self.fail_pull and name.endswith(self.fail_pull):
                        state = {
                            "waiting": {
                                "reason": "ImagePullBackOff",
                                "message": "pull access denied",
                            }
                        }
                    elif c["name"] == "trainer" and self.pod_list_calls > 3:
                        state = {"terminated": {"exitCode": self.trainer_exit}}
                    statuses.append(
                        {
                            "name": c["name"],
                            "image": c["image"],
                            "imageID": "",
                            "ready": "running" in state,
                            "restartCount": 0,
                            "state": state,
                        }
                    )
                items.append(
                    {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "metadata": {"name": f"{name}-{i}", "namespace": "fw-test"},
                        "status": {"phase": "Running", "containerStatuses": statuses},
                    }
                )
        return {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items}


@pytest.fixture
def stand_in():
    clusters: list[StandInCluster] = []
    servers: list[ThreadingHTTPServer] = []

    def start(**kwargs) -> tuple[StandInCluster, Any]:
        from kubernetes import client

        cluster = StandInCluster(**kwargs)

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                code, payload = cluster.route(method, self.path, body)
                data = (
                    payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
                )
                self.send_response(code)
                self.send_header(
                    "Content-Type", "text/plain" if isinstance(payload, str) else "application/json"
                )
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._answer("GET")

            def do_POST(self):
                self._answer("POST")

            def do_DELETE(self):
                self._answer("DELETE")

            def log_message(self, *args):
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        clusters.append(cluster)
        conf = client.Configuration(host=f"http://127.0.0.1:{server.server_address[1]}")
        return cluster, client.ApiClient(conf)

    yield start
    for s in servers:
        s.shutdown()


def run_against(cfg, api_client) -> tuple[int, list[str]]:
    lines: list[str] = []
    runner = k8s.KubernetesRun(cfg, api_client=api_client, out=lines.append, poll_seconds=0.01)
    code = runner.execute(k8s.build_manifests(cfg))
    for thread in runner._followers.values():
        thread.join(timeout=5)
    return code, lines


def test_full_cycle_create_gate_follow_delete(cfg, stand_in):
    cluster, api = stand_in()
    code, lines = run_against(cfg, api)
    assert code == 0, lines
    posts = [p for m, p in cluster.log if m == "POST"]
    assert posts[0] == "/api/v1/namespaces"
    order = [p.rsplit("/", 1)[-1] for p in posts]
    assert order[:4] == ["namespaces", "secrets", "configmaps", "persistentvolumeclaims"]
    # the NetworkPolicies went through the networking API, before any workload
    policy_posts = [i for i, p in enumerate(posts) if p.endswith("/networkpolicies")]
    assert len(policy_posts) == 5
    assert all(p.startswith("/apis/networking.k8s.io/v1/") for p in posts if "networkpolicies" in p)
    assert max(policy_posts) < min(
        i for i, p in enumerate(posts) if p.endswith(("deployments", "statefulsets", "jobs"))
    )

    # gating: the buffer's readiness was read before the rollout was created, and the
    # rollout's before the trainer was created
    def first(method: str, suffix: str) -> int:
        return next(i for i, (m, p) in enumerate(cluster.log) if m == method and p.endswith(suffix))

    rollout_created = next(
        i
        for i, (m, p) in enumerate(cluster.log)
        if m == "POST"
        and p.endswith("statefulsets")
        and i > first("GET", "deployments/demo-flywheel-buffer/status")
    )
    assert first("GET", "statefulsets/demo-flywheel-rollout/status") > rollout_created
    trainer_post = next(
        i for i, (m, p) in enumerate(cluster.log) if m == "POST" and p.endswith("jobs")
    )
    assert first("GET", "statefulsets/demo-flywheel-rollout/status") < trainer_post
    # logs of every container were followed and prefixed
    assert any(
        line.startswith("[trainer demo-flywheel-trainer-0] trainer serving") for line in lines
    ), lines
    assert any(line.startswith("[buffer demo-flywheel-buffer-0]") for line in lines)
    assert "trainer exited with 0" in lines
    # everything created is gone again, except the shared volume (checkpoints live there)
    assert set(cluster.objects) == {("persistentvolumeclaims", "demo-flywheel-shared")}
    deletes = [p for m, p in cluster.log if m == "DELETE"]
    assert deletes[-1] == "/api/v1/namespaces/fw-test"  # created first, deleted last


def test_trainer_failure_is_the_exit_code_and_still_cleans_up(cfg, stand_in):
    cluster, api = stand_in(trainer_exit=3)
    code, lines = run_against(cfg, api)
    assert code == 3 and "trainer exited with 3" in lines
    assert set(cluster.objects) == {("persistentvolumeclaims", "demo-flywheel-shared")}


def test_image_pull_failure_stops_the_run_with_the_reason(cfg, stand_in):
    cluster, api = stand_in(fail_pull="buffer")
    code, lines = run_against(cfg, api)
    assert code == 1
    assert any("demo-flywheel-buffer-0" in line and "ImagePullBackOff" in line for line in lines), (
        lines
    )
    assert ("statefulsets", "demo-flywheel-rollout") not in cluster.objects
    assert set(cluster.objects) == {("persistentvolumeclaims", "demo-flywheel-shared")}


def test_an_existing_namespace_is_used_and_kept(cfg, stand_in):
    cluster, api = stand_in(namespace_exists=True)
    code, _ = run_against(cfg, api)
    assert code == 0
    assert ("namespaces", "fw-test") in cluster.objects
    assert ("DELETE", "/api/v1/namespaces/fw-test") not in cluster.log


def test_tls_from_a_secret_reaches_every_service_pod(cfg):
    """Issue 24: a run launched with TLS was plaintext in the cluster (the launcher dropped
    `services.tls` and mounted nothing). With `scheduler.tls_secret` every Flywheel container
    mounts the Secret and gets the chart's `FLYWHEEL_TLS_*` variables, and its probes are
    HTTP `/readyz` (the kubelet's gRPC probe cannot speak TLS); with TLS set on the launching
    machine but no Secret named, the launch is refused instead of running in plaintext."""
    run_cfg = cfg.model_copy(deep=True)
    run_cfg.services.tls.ca_file = "/home/me/ca.crt"
    with pytest.raises(k8s.KubernetesLaunchError, match="scheduler.tls_secret"):
        k8s.build_manifests(run_cfg)
    run_cfg.services.tls.require_client_cert = False
    run_cfg.services.tls.server_name = "flywheel.internal"
    run_cfg.scheduler.tls_secret = "flywheel-tls"
    objects = by_kind_name(k8s.build_manifests(run_cfg))
    seen = set()
    for (kind, _), obj in objects.items():
        if kind not in ("Deployment", "StatefulSet", "Job"):
            continue
        spec = obj["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in spec["containers"]:
            if c["name"] not in ("buffer", "reward", "rollout", "trainer"):
                continue
            seen.add(c["name"])
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert env["FLYWHEEL_TLS_CERT"] == "/etc/flywheel/tls/tls.crt", c["name"]
            assert env["FLYWHEEL_TLS_KEY"] == "/etc/flywheel/tls/tls.key"
            assert env["FLYWHEEL_TLS_CA"] == "/etc/flywheel/tls/ca.crt"
            assert env["FLYWHEEL_TLS_SERVER_NAME"] == "flywheel.internal"
            assert "FLYWHEEL_TLS_REQUIRE_CLIENT_CERT" not in env
            [mount] = [m for m in c["volumeMounts"] if m["name"] == "tls"]
            assert mount["mountPath"] == "/etc/flywheel/tls" and mount["readOnly"]
            assert volumes["tls"]["secret"]["secretName"] == "flywheel-tls"
            for probe in ("startupProbe", "readinessProbe"):
                assert c[probe]["httpGet"] == {"path": "/readyz", "port": "metrics"}
                assert "grpc" not in c[probe]
    assert seen == {"buffer", "reward", "rollout", "trainer"}
    text = objects[("ConfigMap", "demo-flywheel-config")]["data"]["flywheel.yaml"]
    assert "/home/me" not in text  # this machine's paths stay here
    run_cfg.services.tls.require_client_cert = True
    run_cfg.services.tls.cert_file, run_cfg.services.tls.key_file = "/c.crt", "/c.key"
    for obj in k8s.build_manifests(run_cfg):
        if obj["kind"] in ("Deployment", "StatefulSet", "Job"):
            for c in obj["spec"]["template"]["spec"]["containers"]:
                if c["name"] in seen:
                    env = {e["name"]: e.get("value") for e in c["env"]}
                    assert env["FLYWHEEL_TLS_REQUIRE_CLIENT_CERT"] == "1"
