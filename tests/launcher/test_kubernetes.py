"""The Kubernetes scheduler applies the rendered Helm chart in an order a cluster accepts
(`--dry-run` writes it), and its create / wait / follow-logs / delete cycle runs through
the real `kubernetes` client against a stand-in API server on loopback (no cluster can
exist on this machine; the stand-in implements only the REST calls the launcher makes,
and plays the controllers: pods become ready, the trainer container exits)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
import yaml

from services.common.config import FlywheelConfig, load_config
from services.launcher import kubernetes as k8s
from tests.launcher.k8s_run import OVERRIDES, ROOT


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


# --- the rendered chart, applied ---------------------------------------------------------------
# What the chart renders for a run's config is tested in test_k8s_values.py; here: the order
# the launcher applies it in, and its command line.


def test_objects_are_created_in_an_order_a_cluster_accepts(cfg):
    objects = k8s.manifests(cfg)
    kinds = [o["kind"] for o in objects]
    assert kinds[0] == "Namespace"
    plain = kinds[: kinds.index("StatefulSet")]
    # NetworkPolicies first (no pod ever runs unconfined), then what pods read
    assert plain == sorted(plain, key=k8s.PLAIN_ORDER.index)
    assert plain.count("NetworkPolicy") == 5
    workloads = [(o["kind"], k8s._component(o)) for o in objects if o["kind"] in k8s.WORKLOADS]
    assert workloads == [
        ("StatefulSet", "redis"),
        ("Deployment", "buffer"),
        ("Deployment", "reward"),
        ("StatefulSet", "rollout"),
        ("Job", "trainer"),
    ]
    assert set(kinds[: len(plain)]) | {"StatefulSet", "Deployment", "Job"} == set(kinds)


def test_a_run_without_a_model_on_the_volume_is_refused(capsys):
    cfg = load_config(str(ROOT / "examples" / "grpo.yaml"), ["scheduler.type=kubernetes"])
    assert k8s.run(cfg, dry_run_dir="/nonexistent") == 2
    assert "actor.path is empty" in capsys.readouterr().err


def test_dry_run_writes_the_manifests_in_order(tmp_path, helm_check):
    out = tmp_path / "manifests"
    values = tmp_path / "values.yaml"
    values.write_text(
        "rollout:\n  tolerations: [{key: gpu, operator: Exists, effect: NoSchedule}]\n"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.launcher.kubernetes",
            "--config",
            str(ROOT / "examples" / "grpo.yaml"),
            "--dry-run",
            str(out),
            "--values",
            str(values),
            *OVERRIDES,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    files = sorted(out.iterdir())
    # the namespace, a NetworkPolicy per component, the ServiceAccount, 2 Secrets, the
    # ConfigMap, the shared volume, 7 Services (the trainer's rank 0 has its own), 5 workloads
    assert len(files) == 23 and files[0].name == "00-namespace-fw-test.yaml"
    assert files[1].name == "01-networkpolicy-demo-flywheel-redis.yaml"
    objects = [yaml.safe_load(p.read_text()) for p in files]
    assert helm_check.validate_objects(objects) == []
    assert [o["kind"] for o in objects][-1] == "Job"
    # --values: chart values over the derived ones
    rollout = next(
        o
        for o in objects
        if o["metadata"]["name"] == "demo-flywheel-rollout" and o["kind"] == "StatefulSet"
    )
    assert rollout["spec"]["template"]["spec"]["tolerations"] == [
        {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert rollout["spec"]["replicas"] == 2  # the derived values stay


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
    code = runner.execute(k8s.manifests(cfg))
    for thread in runner._followers.values():
        thread.join(timeout=5)
    return code, lines


def runner_job(cluster: StandInCluster) -> str:
    [name] = [p.rsplit("/", 1)[-1] for m, p in cluster.log if m == "DELETE" and "/jobs/" in p]
    return name


def test_full_cycle_create_gate_follow_delete(cfg, stand_in):
    cluster, api = stand_in()
    code, lines = run_against(cfg, api)
    assert code == 0, lines
    posts = [p for m, p in cluster.log if m == "POST"]
    assert posts[0] == "/api/v1/namespaces"
    order = [p.rsplit("/", 1)[-1] for p in posts]
    assert order[:11] == [
        "namespaces",
        *["networkpolicies"] * 5,
        "serviceaccounts",
        "secrets",
        "secrets",
        "configmaps",
        "persistentvolumeclaims",
    ]
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
    # logs of every container were followed and prefixed; the trainer Job's name carries
    # the chart's revision hash, and its pod 0's exit code is the run's
    assert re.fullmatch(r"demo-flywheel-trainer-[0-9a-f]{6}", runner_job(cluster))
    assert any(
        line.startswith(f"[trainer {runner_job(cluster)}-0] trainer serving") for line in lines
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
