"""A run's config as chart values: what the launcher deploys is the Helm chart
(`deploy/helm/flywheel/`) rendered by the real Helm engine (helm-python-sdk) with
`chart_values(cfg)`. Each test renders a representative run (default, several replicas,
network policies, credentials, TLS, the SGLang engine, an external Redis) and checks the
objects a cluster would receive: kinds, names, replicas, env, args, ports, secrets."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
from typing import Any

import pytest
import yaml

from services.common.config import FlywheelConfig, load_config
from services.common.config.services import ServicesConfig
from services.launcher import k8s_values
from services.launcher import kubernetes as k8s
from tests.launcher.k8s_run import ROOT, load

DOMAIN = "fw-test.svc.cluster.local"
SERVICE_CONTAINERS = ("buffer", "reward", "rollout", "trainer")


@pytest.fixture
def cfg() -> FlywheelConfig:
    return load()


@pytest.fixture(scope="module")
def helm_check():
    spec = importlib.util.spec_from_file_location("helm_check_values", ROOT / "tools/helm_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def keyed(objects: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def trainer_job(objects: list[dict[str, Any]]) -> dict[str, Any]:
    [job] = [o for o in objects if o["kind"] == "Job"]
    assert job["metadata"]["name"].startswith("demo-flywheel-trainer-")  # + revision hash
    return job


def pod_containers(objects: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(pod spec, container) of every container of every workload."""
    return [
        (o["spec"]["template"]["spec"], c)
        for o in objects
        if o["kind"] in k8s.WORKLOADS
        for c in o["spec"]["template"]["spec"]["containers"]
    ]


def env_values(container: dict[str, Any]) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in container.get("env") or []}


def secret_refs(container: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {
        e["name"]: (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
        for e in container.get("env") or []
        if "secretKeyRef" in e.get("valueFrom", {})
    }


def secret_data(obj: dict[str, Any]) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in obj["data"].items()}


def config_map(objects: list[dict[str, Any]]) -> dict[str, Any]:
    text = keyed(objects)[("ConfigMap", "demo-flywheel-config")]["data"]["flywheel.yaml"]
    return yaml.safe_load(text)


def arg_after(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


# --- the mapping itself -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "reference, expected",
    [
        ("ghcr.io/flywheel-rl/flywheel-cpu:0.1.0", ("ghcr.io/flywheel-rl/flywheel-cpu", "0.1.0")),
        ("flywheel:latest", ("flywheel", "latest")),
        ("localhost:5000/flywheel", ("localhost:5000/flywheel", "latest")),
        ("reg.io/fw@sha256:" + "ab" * 32, ("reg.io/fw", "sha256:" + "ab" * 32)),
    ],
)
def test_image_reference_as_repository_and_tag(reference, expected, helm_check, cfg):
    image = k8s_values._image(reference)
    assert (image["repository"], image["tag"]) == expected
    # and the chart writes the reference back as it was given (a digest with "@")
    cfg.scheduler.image = reference
    objects = helm_check.render(k8s_values.chart_values(cfg), name="demo", namespace="fw-test")
    images = {c["image"] for _, c in pod_containers(objects) if c["name"] in SERVICE_CONTAINERS}
    wanted = reference if ":" in reference.rsplit("/", 1)[-1] else f"{reference}:latest"
    assert images == {wanted}


def test_the_chart_config_leaves_out_what_the_chart_derives_and_every_secret(cfg):
    cfg.services.auth_token = "tok-123"
    cfg.services.tls.ca_file = "/home/me/ca.crt"
    cfg.buffer.redis_password = "pw-456"
    data = k8s_values.chart_config(cfg)
    assert set(data["services"]) & {"buffer", "reward", "rollout", "trainer"} == set()
    assert {"auth_token", "credentials", "tls"} & set(data["services"]) == set()
    assert "fileroot" not in data["cluster"]
    assert {"master_addr", "master_port"} & set(data["trainer"]) == set()
    assert {"redis_url", "redis_password", "redis_server"} & set(data["buffer"]) == set()
    text = yaml.safe_dump(data)
    assert "tok-123" not in text and "pw-456" not in text and "/home/me" not in text
    # everything else is the run's config as given
    assert data["actor"] == cfg.model_dump(mode="json")["actor"]
    assert data["rollout"]["n_replicas"] == 2 and data["trainer"]["n_ranks"] == 2


def test_runs_the_pods_cannot_start_are_refused(cfg):
    no_model = load_config(str(ROOT / "examples" / "grpo.yaml"), ["scheduler.type=kubernetes"])
    with pytest.raises(k8s_values.LaunchConfigError, match="actor.path is empty"):
        k8s_values.chart_values(no_model)
    run_cfg = cfg.model_copy(deep=True)
    run_cfg.train_dataset.path = None
    with pytest.raises(k8s_values.LaunchConfigError, match="train_dataset.path is null"):
        k8s_values.chart_values(run_cfg)
    run_cfg = cfg.model_copy(deep=True)
    run_cfg.services.credentials = {"rollout": "sha256:" + "0" * 64}
    with pytest.raises(k8s_values.LaunchConfigError, match="rollout pods need the token"):
        k8s_values.chart_values(run_cfg)


# --- the rendered chart ----------------------------------------------------------------------


def test_default_run_topology_names_and_replicas(cfg, helm_check):
    objects = k8s.manifests(cfg)
    assert helm_check.validate_objects(objects) == []
    assert objects[0] == {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": "fw-test",
            "labels": {
                "app.kubernetes.io/instance": "demo",
                "app.kubernetes.io/part-of": "flywheel",
            },
        },
    }
    assert all(o["metadata"].get("namespace") == "fw-test" for o in objects[1:])
    objs = keyed(objects)
    workloads = {key for key in objs if key[0] in k8s.WORKLOADS and key[0] != "Job"}
    assert workloads == {
        ("StatefulSet", "demo-flywheel-redis"),
        ("Deployment", "demo-flywheel-buffer"),
        ("Deployment", "demo-flywheel-reward"),
        ("StatefulSet", "demo-flywheel-rollout"),
    }
    assert objs[("StatefulSet", "demo-flywheel-rollout")]["spec"]["replicas"] == 2
    assert objs[("Deployment", "demo-flywheel-buffer")]["spec"]["replicas"] == 1
    # no dashboards, PodDisruptionBudgets or prepare Job for a launcher run
    kinds = {o["kind"] for o in objects}
    assert "PodDisruptionBudget" not in kinds and "NetworkPolicy" in kinds
    assert kinds == {*k8s.PLAIN_ORDER, *k8s.WORKLOADS}
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "ConfigMap"] == [
        "demo-flywheel-config"
    ]
    services = {name for kind, name in objs if kind == "Service"}
    assert {"demo-flywheel-buffer", "demo-flywheel-reward", "demo-flywheel-redis"} <= services
    assert {"demo-flywheel-rollout-headless", "demo-flywheel-trainer-headless"} <= services
    buffer_svc = objs[("Service", "demo-flywheel-buffer")]["spec"]["ports"]
    assert [(p["name"], p["port"]) for p in buffer_svc] == [("grpc", 50051), ("metrics", 9400)]
    trainer_svc = objs[("Service", "demo-flywheel-trainer-headless")]["spec"]
    assert trainer_svc["clusterIP"] == "None" and trainer_svc["publishNotReadyAddresses"]
    assert ("rendezvous", 29500) in [(p["name"], p["port"]) for p in trainer_svc["ports"]]
    pvc = objs[("PersistentVolumeClaim", "demo-flywheel-shared")]["spec"]
    assert pvc["resources"]["requests"]["storage"] == "100Gi"
    assert pvc["accessModes"] == ["ReadWriteMany"]
    # the trainer: one pod (an Indexed Job) running n_ranks local ranks, not retried
    job = trainer_job(objects)["spec"]
    assert (job["completionMode"], job["completions"], job["backoffLimit"]) == ("Indexed", 1, 0)
    pod = job["template"]["spec"]
    [trainer] = pod["containers"]
    assert trainer["command"] == ["python", "-m", "services.trainer"]
    args = trainer["args"]
    assert arg_after(args, "--nproc-per-node") == "2" and arg_after(args, "--nnodes") == "1"
    assert arg_after(args, "--node-rank") == "$(POD_INDEX)" and arg_after(args, "--grace") == "270"
    assert args[-1] == "services.trainer.host=0.0.0.0"
    assert pod["restartPolicy"] == "Never" and pod["terminationGracePeriodSeconds"] == 300
    shm = {v["name"]: v for v in pod["volumes"]}["dshm"]["emptyDir"]
    assert shm == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert "nvidia.com/gpu" not in (trainer["resources"].get("limits") or {})  # gloo: no GPU
    # every service container: the launcher's image, grpc + metrics ports, native gRPC probes
    seen = set()
    for _, c in pod_containers(objects):
        if c["name"] not in SERVICE_CONTAINERS:
            continue
        seen.add(c["name"])
        assert c["image"] == "ghcr.io/flywheel-rl/flywheel-cpu:0.1.0"
        assert [(p["name"], p["containerPort"]) for p in c["ports"]] == [
            ("grpc", 50051),
            ("metrics", 9400),
        ]
        service = f"flywheel.v1.{c['name'].capitalize()}Service"
        assert c["readinessProbe"]["grpc"] == {"port": 50051, "service": service}
        assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert seen == set(SERVICE_CONTAINERS)


@pytest.mark.parametrize("replicas", [1, 3])
def test_several_rollout_replicas_each_on_its_own_pod(replicas, helm_check, tmp_path):
    cfg = load(f"rollout.n_replicas={replicas}")
    objects = k8s.manifests(cfg)
    sts = keyed(objects)[("StatefulSet", "demo-flywheel-rollout")]
    assert sts["spec"]["replicas"] == replicas
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert sts["spec"]["serviceName"] == "demo-flywheel-rollout-headless"
    [rollout] = sts["spec"]["template"]["spec"]["containers"]
    assert arg_after(rollout["args"], "--replica-index") == "$(POD_INDEX)"
    data = config_map(objects)
    loaded = FlywheelConfig.model_validate(data)
    assert loaded.rollout.n_replicas == replicas
    assert [loaded.services.rollout.replica_address(i) for i in range(replicas)] == [
        f"demo-flywheel-rollout-{i}.demo-flywheel-rollout-headless.{DOMAIN}:50051"
        for i in range(replicas)
    ]
    # each replica's pod, as the kubelet expands its args, passes its service's --check
    # except for the files only the shared volume holds (model and data)
    path = tmp_path / "flywheel.yaml"
    path.write_text(yaml.safe_dump(data))
    for i in range(replicas):
        env = helm_check.container_env(rollout, f"demo-flywheel-rollout-{i}", i)
        args = [helm_check.expand(a, env) for a in rollout["args"]]
        assert arg_after(args, "--replica-index") == str(i)
        overrides = [a for a in args if "=" in a and not a.startswith("-")]
        assert load_config(str(path), overrides).services.rollout.host == "0.0.0.0"


def test_the_config_map_is_the_run_config_with_cluster_addresses_and_no_secrets(cfg):
    """What every pod loads: the config the user launched, except the addresses, ports and
    paths of the cluster, which point at the chart's objects; no token or password."""
    cfg.services.auth_token = "tok-123"
    cfg.buffer.redis_password = "pw-456"
    objects = k8s.manifests(cfg)
    text = keyed(objects)[("ConfigMap", "demo-flywheel-config")]["data"]["flywheel.yaml"]
    assert "tok-123" not in text and "pw-456" not in text
    loaded = FlywheelConfig.model_validate(yaml.safe_load(text))
    # rank 0 through the Service that selects the current Job's pod 0: no revision hash in
    # the config every pod reads
    assert trainer_job(objects)["metadata"]["name"] not in text
    master = f"demo-flywheel-trainer-0.{DOMAIN}"
    assert loaded.services.buffer.address == f"demo-flywheel-buffer.{DOMAIN}:50051"
    assert loaded.services.reward.address == f"demo-flywheel-reward.{DOMAIN}:50051"
    assert loaded.services.trainer.address == f"{master}:50051"
    assert (loaded.trainer.master_addr, loaded.trainer.master_port) == (master, 29500)
    assert loaded.buffer.redis_url == f"redis://demo-flywheel-redis.{DOMAIN}:6379/0"
    assert loaded.cluster.fileroot == "/data/shared"
    assert loaded.services.auth_token is None and loaded.buffer.redis_password is None

    derived = {
        "services.buffer",
        "services.reward",
        "services.rollout",
        "services.trainer",
        "services.auth_token",
        "trainer.master_addr",
        "trainer.master_port",
        "buffer.redis_url",
        "buffer.redis_password",
        "cluster.fileroot",
        "trainer.weight_dir",  # null here: the run directory's, on the shared volume
    }

    def differences(a: Any, b: Any, path: str = "") -> list[str]:
        if isinstance(a, dict) and isinstance(b, dict):
            return [
                d
                for k in sorted(set(a) | set(b))
                for d in differences(a.get(k), b.get(k), f"{path}.{k}".lstrip("."))
            ]
        return [] if a == b else [path]

    changed = differences(cfg.model_dump(mode="json"), loaded.model_dump(mode="json"))
    assert changed and set(changed) <= {
        p for p in changed if any(p == d or p.startswith(d + ".") for d in derived)
    }, changed
    # the secrets went to the chart's Secrets instead
    data = keyed(objects)
    assert secret_data(data[("Secret", "demo-flywheel-token")])["admin"] == "tok-123"
    assert secret_data(data[("Secret", "demo-flywheel-redis")])["redis-password"] == "pw-456"


def test_each_pod_gets_only_its_own_roles_token(cfg):
    """A token per role in the Secret, the servers only their digests
    (`FLYWHEEL_CREDENTIALS`), rollout and trainer pods their own role's token, buffer and
    reward none, the Redis password only the buffer and Redis."""
    cfg.services.credentials = {"trainer": "tr-tok", "rollout": "ro-tok"}
    objects = k8s.manifests(cfg)
    tokens = secret_data(keyed(objects)[("Secret", "demo-flywheel-token")])
    assert set(tokens) == {"admin", "trainer", "rollout", "launcher", "credentials"}
    assert tokens["trainer"] == "tr-tok" and tokens["rollout"] == "ro-tok"
    digests = dict(p.split("=", 1) for p in tokens["credentials"].split(","))
    assert digests["rollout"] == "sha256:" + hashlib.sha256(b"ro-tok").hexdigest()
    assert digests["admin"] == "sha256:" + hashlib.sha256(tokens["admin"].encode()).hexdigest()
    ServicesConfig(credentials=digests)  # the servers accept the digests as they are
    assert "tr-tok" not in yaml.safe_dump(config_map(objects))
    expected = {"buffer": None, "reward": None, "rollout": "rollout", "trainer": "trainer"}
    seen = set()
    for _, c in pod_containers(objects):
        refs = secret_refs(c)
        if c["name"] in expected:
            seen.add(c["name"])
            assert refs["FLYWHEEL_CREDENTIALS"] == ("demo-flywheel-token", "credentials")
            token = refs.get("FLYWHEEL_TOKEN")
            assert (token[1] if token else None) == expected[c["name"]], c["name"]
        has_redis = ("demo-flywheel-redis", "redis-password") in refs.values()
        assert has_redis == (c["name"] in ("buffer", "redis")), c["name"]
    assert seen == set(expected)


def test_network_policies_per_component_with_disk_and_distributed_weights(cfg):
    """One policy per component, ingress and egress, from the chart's files/network.yaml,
    created before any workload; distributed weights (NCCL between trainer and replicas)
    open trainer <-> rollout to any port."""
    for transport in ("disk", "distributed"):
        run_cfg = cfg.model_copy(deep=True)
        run_cfg.trainer.weight_transport = transport
        objects = k8s.manifests(run_cfg)
        policies = {
            o["metadata"]["name"].removeprefix("demo-flywheel-"): o["spec"]
            for o in objects
            if o["kind"] == "NetworkPolicy"
        }
        assert sorted(policies) == ["buffer", "redis", "reward", "rollout", "trainer"]
        kinds = [o["kind"] for o in objects]
        first_workload = min(kinds.index(k) for k in k8s.WORKLOADS)
        assert max(i for i, k in enumerate(kinds) if k == "NetworkPolicy") < first_workload

        def peers(rules: list[dict[str, Any]], key: str) -> list[tuple[str | None, Any]]:
            out = []
            for r in rules:
                who = [
                    p["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
                    for p in r.get(key, [])
                    if "podSelector" in p and "namespaceSelector" not in p
                ]
                ports = [p["port"] for p in r.get("ports", [])]
                out.append((who[0] if who else None, ports or "any"))
            return out

        distributed = transport == "distributed"
        assert peers(policies["redis"]["ingress"], "from") == [("buffer", [6379])]
        assert policies["redis"]["egress"] == []
        assert peers(policies["reward"]["ingress"], "from") == [
            ("rollout", [50051]),
            (None, [9400]),
        ]
        assert peers(policies["buffer"]["egress"], "to") == [("redis", [6379]), (None, [53, 53])]
        rollout_in = peers(policies["rollout"]["ingress"], "from")
        assert ("trainer", [50051]) in rollout_in
        assert (("trainer", "any") in rollout_in) == distributed
        trainer_egress = peers(policies["trainer"]["egress"], "to")
        assert ("buffer", [50051]) in trainer_egress and ("rollout", [50051]) in trainer_egress
        assert (("rollout", "any") in trainer_egress) == distributed
        # the metrics ports only from the monitoring namespace
        metrics = policies["buffer"]["ingress"][-1]
        assert metrics["ports"] == [{"port": 9400, "protocol": "TCP"}]
        assert metrics["from"] == [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
        ]


def test_an_external_redis(cfg, helm_check):
    cfg.buffer.redis_url = "redis://redis.example:6380/0"
    cfg.buffer.redis_password = "ext-pw"
    objects = k8s.manifests(cfg)
    assert helm_check.validate_objects(objects) == []
    objs = keyed(objects)
    assert ("StatefulSet", "demo-flywheel-redis") not in objs
    assert ("NetworkPolicy", "demo-flywheel-redis") not in objs
    egress = objs[("NetworkPolicy", "demo-flywheel-buffer")]["spec"]["egress"]
    assert egress[0] == {"ports": [{"port": 6380, "protocol": "TCP"}]}  # wherever it lives
    assert config_map(objects)["buffer"]["redis_url"] == "redis://redis.example:6380/0"
    assert secret_data(objs[("Secret", "demo-flywheel-redis")]) == {"redis-password": "ext-pw"}
    [buffer] = objs[("Deployment", "demo-flywheel-buffer")]["spec"]["template"]["spec"][
        "containers"
    ]
    assert secret_refs(buffer)["FLYWHEEL_REDIS_PASSWORD"] == (
        "demo-flywheel-redis",
        "redis-password",
    )


def test_the_sglang_engine_runs_beside_each_replica_on_gpu_nodes(helm_check):
    cfg = load(
        "rollout.engine=sglang",
        "rollout.sglang.tp_size=2",
        "+rollout.sglang.launch_args.mem_fraction_static=0.7",
        "+rollout.sglang.launch_args.context_length=4096",
        "trainer.backend=nccl",
        "trainer.device=cuda",
        "+scheduler.node_selector.gpu=h100",
    )
    objects = k8s.manifests(cfg)
    assert helm_check.validate_objects(objects) == []
    objs = keyed(objects)
    pod = objs[("StatefulSet", "demo-flywheel-rollout")]["spec"]["template"]["spec"]
    by_name = {c["name"]: c for c in pod["containers"]}
    assert set(by_name) == {"rollout", "sglang"}
    sglang = by_name["sglang"]
    assert sglang["image"] == "ghcr.io/flywheel-rl/flywheel-cpu:0.1.0"  # the run's image
    assert sglang["command"] == ["/opt/venv/bin/python", "-m", "sglang.launch_server"]
    args = sglang["args"]
    assert arg_after(args, "--model-path") == "/data/shared/models/tiny"
    assert arg_after(args, "--host") == "127.0.0.1" and arg_after(args, "--port") == "30000"
    assert arg_after(args, "--tp-size") == "2"
    assert arg_after(args, "--mem-fraction-static") == "0.7"
    assert args.count("--mem-fraction-static") == 1
    assert arg_after(args, "--context-length") == "4096"
    assert arg_after(args, "--api-key") == "$(SGLANG_API_KEY)"
    assert sglang["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert pod["nodeSelector"] == {"gpu": "h100"}
    # the key: one Secret, read by the server and by its only client, the rollout service
    key = secret_data(objs[("Secret", "demo-flywheel-sglang")])["api-key"]
    assert len(key) == 48
    for c in (sglang, by_name["rollout"]):
        assert secret_refs(c)["SGLANG_API_KEY"] == ("demo-flywheel-sglang", "api-key")
    data = config_map(objects)
    assert data["rollout"]["engine"] == "sglang"
    assert data["rollout"]["sglang"]["url"] == "http://127.0.0.1:30000"
    job = trainer_job(objects)["spec"]["template"]["spec"]
    assert job["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert job["nodeSelector"] == {"gpu": "h100"}
    # the buffer and reward need no GPU node
    buffer_pod = objs[("Deployment", "demo-flywheel-buffer")]["spec"]["template"]["spec"]
    assert "nodeSelector" not in buffer_pod


def test_an_sglang_server_the_config_names_is_used_as_it_is():
    cfg = load("rollout.engine=sglang", "rollout.sglang.url=http://sglang.gpu:30000")
    objects = k8s.manifests(cfg)
    rollout = keyed(objects)[("StatefulSet", "demo-flywheel-rollout")]
    assert [c["name"] for c in rollout["spec"]["template"]["spec"]["containers"]] == ["rollout"]
    assert config_map(objects)["rollout"]["sglang"]["url"] == "http://sglang.gpu:30000"
    assert ("Secret", "demo-flywheel-sglang") not in keyed(objects)


def test_tls_from_a_secret_reaches_every_service_pod(cfg):
    """With `scheduler.tls_secret` every Flywheel container mounts the Secret, gets the
    chart's `FLYWHEEL_TLS_*` variables, and its probes are HTTP `/readyz` (the kubelet's gRPC
    probe cannot speak TLS); TLS set on the launching machine without a Secret is refused
    instead of running in plaintext."""
    cfg.services.tls.ca_file = "/home/me/ca.crt"
    with pytest.raises(k8s_values.LaunchConfigError, match="scheduler.tls_secret"):
        k8s.manifests(cfg)
    cfg.services.tls.server_name = "flywheel.internal"
    cfg.scheduler.tls_secret = "flywheel-tls"
    for mtls in (False, True):
        cfg.services.tls.require_client_cert = mtls
        if mtls:
            cfg.services.tls.cert_file, cfg.services.tls.key_file = "/c.crt", "/c.key"
        objects = k8s.manifests(cfg)
        seen = set()
        for spec, c in pod_containers(objects):
            if c["name"] not in SERVICE_CONTAINERS:
                continue
            seen.add(c["name"])
            env = env_values(c)
            assert env["FLYWHEEL_TLS_CERT"] == "/etc/flywheel-tls/tls.crt", c["name"]
            assert env["FLYWHEEL_TLS_KEY"] == "/etc/flywheel-tls/tls.key"
            assert env["FLYWHEEL_TLS_CA"] == "/etc/flywheel-tls/ca.crt"
            assert env["FLYWHEEL_TLS_SERVER_NAME"] == "flywheel.internal"
            assert env.get("FLYWHEEL_TLS_REQUIRE_CLIENT_CERT") == ("1" if mtls else None)
            [mount] = [m for m in c["volumeMounts"] if m["name"] == "tls"]
            assert mount == {"name": "tls", "mountPath": "/etc/flywheel-tls", "readOnly": True}
            volumes = {v["name"]: v for v in spec["volumes"]}
            assert volumes["tls"]["secret"]["secretName"] == "flywheel-tls"
            for probe in ("startupProbe", "readinessProbe"):
                assert c[probe]["httpGet"] == {"path": "/readyz", "port": "metrics"}
        assert seen == set(SERVICE_CONTAINERS)
        assert "/home/me" not in yaml.safe_dump(config_map(objects))


@pytest.mark.parametrize(
    "extra",
    [
        (),
        ("rollout.n_replicas=3",),
        ("rollout.engine=sglang", "trainer.backend=nccl", "trainer.device=cuda"),
    ],
    ids=["default", "3-replicas", "sglang-nccl"],
)
def test_every_pod_of_the_run_would_start(extra, helm_check):
    """helm_check's preflight: each Flywheel container of each pod runs its service's
    `--check` on the ConfigMap with its own args and environment, as the kubelet expands
    them. The values the launcher derives must agree with the config they carry."""
    assert helm_check.preflight(k8s.manifests(load(*extra))) == []


def test_values_that_disagree_with_the_config_are_refused_at_render():
    """The run says 2 ranks, the pods would hold 3: the chart refuses to render (before,
    it rendered and the preflight found the trainer pod exiting 2 on the rank layout)."""
    from services.launcher.helm_render import HelmRenderError

    with pytest.raises(HelmRenderError) as err:
        k8s.manifests(load(), extra_values={"trainer": {"nprocPerNode": 3}})
    assert "config.trainer.n_ranks=2: the chart sets it to 3" in str(err.value)
    assert "trainer.nodes x trainer.nprocPerNode" in str(err.value)
