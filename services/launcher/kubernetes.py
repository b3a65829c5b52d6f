"""`flywheel run scheduler.type=kubernetes`: the same topology as a local run, as pods.

The launcher builds the objects itself (no Helm needed on the user's machine) with the
names and layout of the Helm chart in `deploy/helm/flywheel/`: a namespace, one Secret
(Redis password, a token per caller role and their digests), one ConfigMap holding the
resolved `flywheel.yaml`, a NetworkPolicy per component (`NETWORK`),
Redis as a StatefulSet with AOF on a volume (unless `buffer.redis_url` points at an
existing Redis), the buffer and reward as Deployments, the rollout replicas as a
StatefulSet (replica i is pod i) with a headless Service, the trainer as an Indexed Job of
one pod whose supervisor runs `trainer.n_ranks` local ranks, and a shared volume for
checkpoints and published weights. It then creates them with the `kubernetes` client,
waits for each stage to be ready in the order the local launcher uses (Redis, then buffer
and reward, then rollout, then trainer), follows every container's logs, and deletes what
it created when the trainer finishes, when a pod fails for good, or on Ctrl-C.

`--dry-run` writes the manifests to a folder instead (`kubectl apply -f DIR` applies
them in order). Multi-node trainers and autoscaling are the chart's job.

    python -m services.launcher.kubernetes --config run.yaml [overrides] [--dry-run DIR]
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import logging
import secrets
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml

from services.common.config import FlywheelConfig, load_config
from services.common.config.services import ROLES

log = logging.getLogger("flywheel.launcher.kubernetes")

GRPC_PORT = 50051
METRICS_PORT = 9400
RENDEZVOUS_PORT = 29500
SGLANG_PORT = 30000
SGLANG_PYTHON = "/opt/venv/bin/python"  # the GPU image's one environment (Dockerfile.gpu)
SGLANG_CACHE = "/var/cache/sglang"
# The root filesystem is read-only: HOME and every kernel cache SGLang points under
# SGLANG_CACHE_DIR (SGLang's srt/environ.py) live on the pod's own emptyDir, as in the chart.
SGLANG_CACHE_ENV = {
    "HOME": f"{SGLANG_CACHE}/home",
    "XDG_CACHE_HOME": f"{SGLANG_CACHE}/xdg",
    "HF_HOME": f"{SGLANG_CACHE}/hf",
    "SGLANG_CACHE_DIR": f"{SGLANG_CACHE}/sglang",
    "TRITON_CACHE_DIR": f"{SGLANG_CACHE}/sglang/triton",
    "TORCHINDUCTOR_CACHE_DIR": f"{SGLANG_CACHE}/sglang/inductor",
    "CUDA_CACHE_PATH": f"{SGLANG_CACHE}/sglang/nv",
    "TILELANG_CACHE_DIR": f"{SGLANG_CACHE}/sglang/tilelang",
    "FLASHINFER_WORKSPACE_BASE": f"{SGLANG_CACHE}/sglang",
}


def _sglang_ping() -> list[str]:
    """SGLang's `/ping` from inside its container (it listens on loopback only): 200 once
    started, paused or not, and it generates nothing, unlike `/health`; it sends the API key
    when the container has one (SGLang exempts only /health*, /ready*, /metrics*)."""
    script = (
        "import os, urllib.request as u; k = os.environ.get('SGLANG_API_KEY'); "
        f"u.urlopen(u.Request('http://127.0.0.1:{SGLANG_PORT}/ping', headers="
        "{'Authorization': 'Bearer ' + k} if k else {}), timeout=5)"
    )
    return [SGLANG_PYTHON, "-c", script]


SHARED_MOUNT = "/data/shared"
CONFIG_MOUNT = "/etc/flywheel"
UID = 10001
COMPONENTS = ("buffer", "reward", "rollout", "trainer")
GRPC_SERVICE = {
    "buffer": "flywheel.v1.BufferService",
    "reward": "flywheel.v1.RewardService",
    "rollout": "flywheel.v1.RolloutService",
    "trainer": "flywheel.v1.TrainerService",
}
# Start order: each stage must be ready before the next starts (as the local launcher).
STAGES: tuple[tuple[str, ...], ...] = (("redis",), ("buffer", "reward"), ("rollout",), ("trainer",))


NETWORK: dict[str, list[dict[str, str]]] = {
    "redis": [{"from": "buffer", "port": "redis"}],
    "buffer": [{"from": "rollout", "port": "grpc"}, {"from": "trainer", "port": "grpc"}],
    "reward": [{"from": "rollout", "port": "grpc"}],
    "rollout": [
        {"from": "trainer", "port": "grpc"},
        {"from": "trainer", "port": "any", "when": "distributed"},
    ],
    "trainer": [
        {"from": "trainer", "port": "any"},
        {"from": "rollout", "port": "any", "when": "distributed"},
    ],
}
"""Who may open a connection to whom (target -> rules), the chart's
`deploy/helm/flywheel/files/network.yaml` (a test keeps the two equal): each rule is an
ingress rule of the target and an egress rule of the source, on the target's `grpc` or
`redis` port or `any` port; `when: distributed` only with `trainer.weight_transport:
distributed` (NCCL between the trainer and the replicas on ports chosen at run time)."""

METRICS_FROM = [
    {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
]
"""Who may scrape the metrics ports: pods of the `monitoring` namespace (the chart's
`networkPolicy.metricsFrom` default)."""

DNS_TO = [
    {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
        "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
    }
]
"""Where DNS egress may go (the chart's `networkPolicy.dns` default)."""


CALLER_ROLES = ("trainer", "rollout")
"""Components that call other services, each with its own role's token."""


def role_tokens(cfg: FlywheelConfig, admin: str | None = None) -> dict[str, str]:
    """A token per role of `services.credentials`: the plain ones the config gives, else
    new ones; `admin` (or `services.auth_token`) as the admin's. A role the config gives
    only as a digest cannot be handed to a pod: generated anew unless it is a caller's."""
    given = {r: t for r, t in cfg.services.credentials.items() if not t.startswith("sha256:")}
    for role in CALLER_ROLES:
        if role in cfg.services.credentials and role not in given:
            raise KubernetesLaunchError(
                f"services.credentials.{role} is a digest: the {role} pods need the token itself"
            )
    tokens = {role: given.get(role) or secrets.token_hex(24) for role in ROLES}
    if admin or cfg.services.auth_token:
        tokens["admin"] = admin or cfg.services.auth_token or tokens["admin"]
    return tokens


def credentials_value(tokens: Mapping[str, str]) -> str:
    """`FLYWHEEL_CREDENTIALS` of the servers: `role=sha256:<hex>` for every role."""
    return ",".join(
        f"{role}=sha256:{hashlib.sha256(token.encode()).hexdigest()}"
        for role, token in tokens.items()
    )


class KubernetesLaunchError(RuntimeError):
    """The cluster run cannot start or failed; the message says which object and why."""


# --- manifests ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Names:
    """Object names of one release, identical to the Helm chart's with the same release."""

    release: str
    namespace: str

    @property
    def prefix(self) -> str:
        return self.release if "flywheel" in self.release else f"{self.release}-flywheel"

    def of(self, component: str) -> str:
        return f"{self.prefix}-{component}"

    def fqdn(self, host: str) -> str:
        return f"{host}.{self.namespace}.svc"


def _labels(names: Names, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "flywheel",
        "app.kubernetes.io/instance": names.release,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": "flywheel-launcher",
        "app.kubernetes.io/part-of": "flywheel",
    }


def _selector(names: Names, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "flywheel",
        "app.kubernetes.io/instance": names.release,
        "app.kubernetes.io/component": component,
    }


def _meta(names: Names, name: str, component: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": names.namespace,
        "labels": _labels(names, component),
        **extra,
    }


def cluster_config(cfg: FlywheelConfig, names: Names) -> dict[str, Any]:
    """The config every pod reads: `cfg` with addresses, ports and paths of the cluster.

    Secrets stay out of it: the tokens, the credentials and the Redis password are left
    unset so that the services read `FLYWHEEL_TOKEN` / `FLYWHEEL_CREDENTIALS` /
    `FLYWHEEL_REDIS_PASSWORD` from the pod's environment (filled from the Secret); so are
    this machine's TLS file paths (a pod takes `FLYWHEEL_TLS_*` from its own environment)."""
    data = cfg.model_dump(mode="json")
    services = data["services"]
    for key in ("auth_token", "credentials", "tls"):
        services.pop(key, None)
    services["buffer"] = {
        "host": names.fqdn(names.of("buffer")),
        "port": GRPC_PORT,
        "metrics_port": METRICS_PORT,
    }
    services["reward"] = {
        "host": names.fqdn(names.of("reward")),
        "port": GRPC_PORT,
        "metrics_port": METRICS_PORT,
    }
    services["rollout"] = {
        "host": names.fqdn(f"{names.of('rollout')}-{{i}}.{names.of('rollout')}-headless"),
        "port": GRPC_PORT,
        "metrics_port": METRICS_PORT,
        "port_stride": 0,
    }
    trainer_host = names.fqdn(f"{names.of('trainer')}-0.{names.of('trainer')}-headless")
    services["trainer"] = {"host": trainer_host, "port": GRPC_PORT, "metrics_port": METRICS_PORT}
    data["cluster"]["fileroot"] = SHARED_MOUNT
    data["trainer"]["master_addr"] = trainer_host
    data["trainer"]["master_port"] = RENDEZVOUS_PORT
    if not cfg.buffer.redis_url:
        data["buffer"]["redis_url"] = f"redis://{names.fqdn(names.of('redis'))}:6379/0"
    data["buffer"]["redis_password"] = None
    data["buffer"]["redis_server"] = None
    if cfg.rollout.engine == "sglang" and not cfg.rollout.sglang.url:
        data["rollout"]["sglang"]["url"] = f"http://127.0.0.1:{SGLANG_PORT}"
    return data


def _check_runnable(cfg: FlywheelConfig) -> None:
    """Pods only read files: a model and data sets must already be on the shared volume."""
    if not cfg.actor.path:
        raise KubernetesLaunchError(
            "actor.path is empty: on Kubernetes the model must already be on the shared volume "
            f"(e.g. actor.path={SHARED_MOUNT}/models/<name>); the tiny demo model is written "
            "only by the local launcher"
        )
    if cfg.services.tls.client_enabled and not cfg.scheduler.tls_secret:
        raise KubernetesLaunchError(
            "services.tls is set on this machine, but the pods would serve plaintext: create a "
            "Secret with tls.crt, tls.key and ca.crt in the run's namespace (e.g. by "
            "cert-manager) and set scheduler.tls_secret=<its name>"
        )
    if not cfg.train_dataset.path:
        raise KubernetesLaunchError(
            "train_dataset.path is null: on Kubernetes the data set must be a file on the shared "
            f"volume (e.g. train_dataset.path={SHARED_MOUNT}/data/train.jsonl)"
        )


def _probes(component: str, *, tls: bool = False) -> dict[str, Any]:
    """Native gRPC startup/readiness (NOT_SERVING while draining or applying weights takes a
    pod out of its Service), HTTP liveness (such a pod must not be restarted). Under TLS the
    kubelet's gRPC probe (plaintext only) cannot connect: readiness is then the metrics
    port's `/readyz`, which is 200 exactly while the gRPC health is SERVING."""
    check: dict[str, Any] = (
        {"httpGet": {"path": "/readyz", "port": "metrics"}}
        if tls
        else {"grpc": {"port": GRPC_PORT, "service": GRPC_SERVICE[component]}}
    )
    return {
        "startupProbe": {
            **check,
            "periodSeconds": 10,
            "failureThreshold": 90,
            "timeoutSeconds": 3,
        },
        "readinessProbe": {
            **check,
            "periodSeconds": 5,
            "failureThreshold": 3,
            "timeoutSeconds": 3,
        },
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "metrics"},
            "periodSeconds": 10,
            "failureThreshold": 6,
            "timeoutSeconds": 3,
        },
    }


TLS_MOUNT = "/etc/flywheel/tls"


def _tls_env(cfg: FlywheelConfig) -> list[dict[str, Any]]:
    """`FLYWHEEL_TLS_*` of a pod that mounts `scheduler.tls_secret` at TLS_MOUNT: the same
    variables the chart sets, so a service reads its certificate the same way everywhere."""
    env = [
        {"name": "FLYWHEEL_TLS_CERT", "value": f"{TLS_MOUNT}/tls.crt"},
        {"name": "FLYWHEEL_TLS_KEY", "value": f"{TLS_MOUNT}/tls.key"},
        {"name": "FLYWHEEL_TLS_CA", "value": f"{TLS_MOUNT}/ca.crt"},
    ]
    if cfg.services.tls.require_client_cert:
        env.append({"name": "FLYWHEEL_TLS_REQUIRE_CLIENT_CERT", "value": "1"})
    if cfg.services.tls.server_name:
        env.append({"name": "FLYWHEEL_TLS_SERVER_NAME", "value": cfg.services.tls.server_name})
    return env


_CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
}
_POD_SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": UID,
    "runAsGroup": UID,
    "fsGroup": UID,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def _service_container(
    cfg: FlywheelConfig,
    names: Names,
    component: str,
    *,
    command: list[str],
    extra_args: Iterable[str] = (),
    extra_env: Iterable[Mapping[str, Any]] = (),
    shared: bool = False,
    resources: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    secret = names.of("secrets")

    def from_secret(name: str, key: str) -> dict[str, Any]:
        return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}

    # Servers check callers against the digests; only callers hold a token, their own
    # role's (the chart's auth.perService): the buffer and reward dial no Flywheel service.
    env: list[dict[str, Any]] = [
        {"name": "FLYWHEEL_CONFIG", "value": f"{CONFIG_MOUNT}/flywheel.yaml"},
        from_secret("FLYWHEEL_CREDENTIALS", "credentials"),
    ]
    if component in CALLER_ROLES:
        env.append(from_secret("FLYWHEEL_TOKEN", component))
    if component == "buffer":
        env.append(
            {
                "name": "FLYWHEEL_REDIS_PASSWORD",
                "valueFrom": {
                    "secretKeyRef": {"name": secret, "key": "redis-password", "optional": True}
                },
            }
        )
    env.extend(dict(e) for e in extra_env)
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    tls = bool(cfg.scheduler.tls_secret)
    if tls:
        env.extend(_tls_env(cfg))
        mounts.append({"name": "tls", "mountPath": TLS_MOUNT, "readOnly": True})
    if shared:
        mounts.append({"name": "shared", "mountPath": SHARED_MOUNT})
    return {
        "name": component,
        "image": cfg.scheduler.image,
        "imagePullPolicy": cfg.scheduler.image_pull_policy,
        "command": command,
        # The service binds 0.0.0.0 in its own pod; everyone else dials the ConfigMap's name.
        "args": [
            "--config",
            f"{CONFIG_MOUNT}/flywheel.yaml",
            *extra_args,
            f"services.{component}.host=0.0.0.0",
        ],
        "env": env,
        "ports": [
            {"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
        ],
        **_probes(component, tls=tls),
        "resources": dict(resources or {}),
        "securityContext": copy.deepcopy(_CONTAINER_SECURITY),
        "volumeMounts": mounts,
    }


def _pod_spec(
    cfg: FlywheelConfig,
    names: Names,
    containers: list[dict[str, Any]],
    *,
    shared: bool = False,
    shm: str | None = None,
    gpu: bool = False,
) -> dict[str, Any]:
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": names.of("config")}},
        {"name": "tmp", "emptyDir": {}},
    ]
    if shared:
        volumes.append(
            {"name": "shared", "persistentVolumeClaim": {"claimName": names.of("shared")}}
        )
    if cfg.scheduler.tls_secret:
        volumes.append(
            {
                "name": "tls",
                "secret": {"secretName": cfg.scheduler.tls_secret, "defaultMode": 0o440},
            }
        )
    if shm:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}})
    if any(c["name"] == "sglang" for c in containers):
        volumes.append({"name": "sglang-cache", "emptyDir": {}})
    spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "securityContext": copy.deepcopy(_POD_SECURITY),
        "terminationGracePeriodSeconds": 120,
        "containers": containers,
        "volumes": volumes,
    }
    if gpu and cfg.scheduler.node_selector:
        spec["nodeSelector"] = dict(cfg.scheduler.node_selector)
    return spec


def _service(
    names: Names, component: str, *, headless: bool, extra_ports: Iterable[Mapping[str, Any]] = ()
) -> dict[str, Any]:
    name = names.of(component) + ("-headless" if headless else "")
    spec: dict[str, Any] = {
        "selector": _selector(names, component),
        "ports": [
            {"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "appProtocol": "grpc"},
            {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics"},
            *[dict(p) for p in extra_ports],
        ],
    }
    if headless:
        # Not-ready pods stay resolvable: a rollout replica applying weights, or trainer
        # pod 0 during the rendezvous, must still be reachable by its name.
        spec.update(clusterIP="None", publishNotReadyAddresses=True)
    else:
        spec["type"] = "ClusterIP"
    meta = _meta(names, name, component)
    meta["labels"].update(
        {"flywheel.io/metrics": "true", "flywheel.io/job": f"flywheel-{component}"}
    )
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": spec}


def _workload(
    kind: str,
    names: Names,
    component: str,
    replicas: int,
    pod_spec: dict[str, Any],
    **spec_extra: Any,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "replicas": replicas,
        "selector": {"matchLabels": _selector(names, component)},
        "template": {"metadata": {"labels": _labels(names, component)}, "spec": pod_spec},
        **spec_extra,
    }
    return {
        "apiVersion": "apps/v1",
        "kind": kind,
        "metadata": _meta(names, names.of(component), component),
        "spec": spec,
    }


_POD_INDEX_ENV = {
    "name": "POD_INDEX",
    "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}},
}
_JOB_INDEX_ENV = {
    "name": "POD_INDEX",
    "valueFrom": {
        "fieldRef": {
            "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        }
    },
}
TRAINER_GRACE_S = 300


def build_manifests(
    cfg: FlywheelConfig,
    *,
    redis_password: str | None = None,
    token: str | None = None,
    shared_size: str = "100Gi",
    redis_size: str = "8Gi",
) -> list[dict[str, Any]]:
    """Every object of the run, in the order they are created."""
    _check_runnable(cfg)
    names = Names(cfg.scheduler.release_name, cfg.scheduler.namespace)
    external_redis = bool(cfg.buffer.redis_url)
    config_data = cluster_config(cfg, names)
    FlywheelConfig.model_validate(config_data)  # what the pods will load must load here
    redis_password = redis_password if redis_password is not None else cfg.buffer.redis_password
    if redis_password is None and not external_redis:
        redis_password = secrets.token_hex(16)
    tokens = role_tokens(cfg, token)
    gpu_trainer = cfg.trainer.backend == "nccl"
    sglang = cfg.rollout.engine == "sglang" and not cfg.rollout.sglang.url

    objects: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": names.namespace, "labels": _labels(names, "namespace")},
        },
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": _meta(names, names.of("secrets"), "secrets"),
            "type": "Opaque",
            "stringData": {
                **tokens,
                "credentials": credentials_value(tokens),
                **({"redis-password": redis_password} if redis_password else {}),
            },
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _meta(names, names.of("config"), "config"),
            "data": {"flywheel.yaml": yaml.safe_dump(config_data, sort_keys=False)},
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": _meta(names, names.of("shared"), "shared"),
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "resources": {"requests": {"storage": shared_size}},
            },
        },
    ]
    # Before any pod exists: no pod ever runs unconfined.
    objects += network_policies(cfg, names)

    if not external_redis:
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": _meta(names, names.of("redis"), "redis"),
                "spec": {
                    "type": "ClusterIP",
                    "selector": _selector(names, "redis"),
                    "ports": [{"name": "redis", "port": 6379, "targetPort": "redis"}],
                },
            }
        )
        redis_pod = {
            "automountServiceAccountToken": False,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": 999,
                "runAsGroup": 999,
                "fsGroup": 999,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [
                {
                    "name": "redis",
                    "image": "redis:7.4-alpine",
                    # The password goes through a file on a tmpfs, never the command line.
                    "command": [
                        "sh",
                        "-c",
                        'printf \'requirepass "%s"\\n\' "$REDIS_PASSWORD" > /tmp/redis.conf\n'
                        "exec redis-server /tmp/redis.conf --dir /data --appendonly yes --appendfsync everysec",
                    ],
                    "env": [
                        {
                            "name": "REDIS_PASSWORD",
                            "valueFrom": {
                                "secretKeyRef": {
                                    "name": names.of("secrets"),
                                    "key": "redis-password",
                                }
                            },
                        },
                        {
                            "name": "REDISCLI_AUTH",
                            "valueFrom": {
                                "secretKeyRef": {
                                    "name": names.of("secrets"),
                                    "key": "redis-password",
                                }
                            },
                        },
                    ],
                    "ports": [{"name": "redis", "containerPort": 6379, "protocol": "TCP"}],
                    "readinessProbe": {
                        "exec": {"command": ["sh", "-c", "redis-cli ping | grep -q PONG"]},
                        "periodSeconds": 5,
                        "timeoutSeconds": 3,
                    },
                    "securityContext": copy.deepcopy(_CONTAINER_SECURITY),
                    "volumeMounts": [
                        {"name": "data", "mountPath": "/data"},
                        {"name": "tmp", "mountPath": "/tmp"},
                    ],
                }
            ],
            "volumes": [{"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}],
        }
        objects.append(
            _workload(
                "StatefulSet",
                names,
                "redis",
                1,
                redis_pod,
                serviceName=names.of("redis"),
                volumeClaimTemplates=[
                    {
                        "apiVersion": "v1",
                        "kind": "PersistentVolumeClaim",
                        "metadata": {"name": "data"},
                        "spec": {
                            "accessModes": ["ReadWriteOnce"],
                            "resources": {"requests": {"storage": redis_size}},
                        },
                    }
                ],
            )
        )

    for component in ("buffer", "reward"):
        objects.append(_service(names, component, headless=False))
        container = _service_container(
            cfg, names, component, command=["python", "-m", f"services.{component}"]
        )
        objects.append(
            _workload(
                "Deployment",
                names,
                component,
                1,
                _pod_spec(cfg, names, [container]),
                strategy={"type": "Recreate"}
                if component == "buffer"
                else {"type": "RollingUpdate"},
            )
        )

    rollout_containers = [
        _service_container(
            cfg,
            names,
            "rollout",
            command=["python", "-m", "services.rollout"],
            extra_args=["--replica-index", "$(POD_INDEX)"],
            extra_env=[_POD_INDEX_ENV],
            shared=True,
        )
    ]
    if sglang:
        tp = cfg.rollout.sglang.tp_size
        probe = {
            "exec": {"command": _sglang_ping()},
            "periodSeconds": 10,
            "timeoutSeconds": 8,
        }
        rollout_containers.append(
            {
                "name": "sglang",
                "image": cfg.scheduler.image,
                "imagePullPolicy": cfg.scheduler.image_pull_policy,
                "command": [SGLANG_PYTHON, "-m", "sglang.launch_server"],
                "args": [
                    "--model-path",
                    cfg.actor.path,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(SGLANG_PORT),
                    "--tp-size",
                    str(tp),
                ]
                + [
                    a
                    for k, v in cfg.rollout.sglang.launch_args.items()
                    for a in (f"--{k.replace('_', '-')}", str(v))
                ],
                "env": [{"name": k, "value": v} for k, v in SGLANG_CACHE_ENV.items()],
                "startupProbe": {**probe, "failureThreshold": 90},
                "livenessProbe": {**probe, "periodSeconds": 30, "failureThreshold": 5},
                "readinessProbe": {**probe, "failureThreshold": 3},
                "resources": {"limits": {"nvidia.com/gpu": tp}},
                "securityContext": copy.deepcopy(_CONTAINER_SECURITY),
                "volumeMounts": [
                    {"name": "tmp", "mountPath": "/tmp"},
                    {"name": "dshm", "mountPath": "/dev/shm"},
                    {"name": "sglang-cache", "mountPath": SGLANG_CACHE},
                    {"name": "shared", "mountPath": SHARED_MOUNT},
                ],
            }
        )
    objects.append(_service(names, "rollout", headless=True))
    objects.append(
        _workload(
            "StatefulSet",
            names,
            "rollout",
            cfg.rollout.n_replicas,
            _pod_spec(
                cfg,
                names,
                rollout_containers,
                shared=True,
                shm="16Gi" if sglang else None,
                gpu=sglang,
            ),
            serviceName=f"{names.of('rollout')}-headless",
            podManagementPolicy="Parallel",
        )
    )

    n = cfg.trainer.n_ranks
    trainer_env = [_JOB_INDEX_ENV]
    trainer = _service_container(
        cfg,
        names,
        "trainer",
        # The trainer's own supervisor as the main process, not torchrun: on SIGTERM rank 0
        # finishes its step and checkpoints within the grace period (torchrun kills its
        # workers after 30 s and exits 1).
        command=["python", "-m", "services.trainer"],
        extra_args=[
            "--nnodes",
            "1",
            "--node-rank",
            "$(POD_INDEX)",
            "--nproc-per-node",
            str(n),
            "--grace",
            str(TRAINER_GRACE_S - 30),
        ],
        extra_env=trainer_env,
        shared=True,
        resources={"limits": {"nvidia.com/gpu": n}} if gpu_trainer else None,
    )
    trainer["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})
    objects.append(
        _service(
            names,
            "trainer",
            headless=True,
            extra_ports=[
                {"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT}
            ],
        )
    )
    pod = _pod_spec(cfg, names, [trainer], shared=True, shm="8Gi", gpu=gpu_trainer)
    pod.update(
        restartPolicy="Never",
        subdomain=f"{names.of('trainer')}-headless",
        terminationGracePeriodSeconds=TRAINER_GRACE_S,
    )
    objects.append(_trainer_job(names, pod))
    return objects


def network_policies(cfg: FlywheelConfig, names: Names) -> list[dict[str, Any]]:
    """One NetworkPolicy per component from `NETWORK`, ingress and egress: each reaches
    exactly its peers (and DNS; Redis nothing), the metrics ports only `METRICS_FROM`."""
    distributed = cfg.trainer.weight_transport == "distributed"
    external = bool(cfg.buffer.redis_url)
    redis_port = (urlparse(cfg.buffer.redis_url or "").port or 6379) if external else 6379
    targets = [c for c in NETWORK if not (c == "redis" and external)]

    def applies(rule: Mapping[str, str]) -> bool:
        return rule.get("when") != "distributed" or distributed

    def ports(rule: Mapping[str, str]) -> dict[str, Any]:
        if rule["port"] == "any":
            return {}
        port = redis_port if rule["port"] == "redis" else GRPC_PORT
        return {"ports": [{"port": port, "protocol": "TCP"}]}

    policies = []
    for to in targets:
        ingress: list[dict[str, Any]] = [
            {"from": [{"podSelector": {"matchLabels": _selector(names, r["from"])}}], **ports(r)}
            for r in NETWORK[to]
            if applies(r)
        ]
        egress: list[dict[str, Any]] = []
        for target, rules in NETWORK.items():
            for r in rules:
                if r["from"] != to or not applies(r):
                    continue
                if target == "redis" and external:
                    egress.append(ports(r))  # the external Redis, wherever it is
                else:
                    peer = {"podSelector": {"matchLabels": _selector(names, target)}}
                    egress.append({"to": [peer], **ports(r)})
        if to != "redis":
            ingress.append(
                {
                    "ports": [{"port": METRICS_PORT, "protocol": "TCP"}],
                    "from": copy.deepcopy(METRICS_FROM),
                }
            )
            dns = [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]
            egress.append({"ports": dns, "to": copy.deepcopy(DNS_TO)})
        policies.append(
            {
                "apiVersion": "networking.k8s.io/v1",
                "kind": "NetworkPolicy",
                "metadata": _meta(names, names.of(to), to),
                "spec": {
                    "podSelector": {"matchLabels": _selector(names, to)},
                    "policyTypes": ["Ingress", "Egress"],
                    "ingress": ingress,
                    "egress": egress,
                },
            }
        )
    return policies


def _trainer_job(names: Names, pod_spec: dict[str, Any]) -> dict[str, Any]:
    """The trainer as an Indexed Job of one pod, as in the chart: it ends as Complete
    (never restarted after `total_train_steps`); pod 0's hostname `<job>-0` in the
    headless Service's subdomain is the rendezvous address."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _meta(names, names.of("trainer"), "trainer"),
        "spec": {
            "completionMode": "Indexed",
            "completions": 1,
            "parallelism": 1,
            "backoffLimit": 0,  # the launcher reports a failure; `flywheel run` resumes
            "template": {"metadata": {"labels": _labels(names, "trainer")}, "spec": pod_spec},
        },
    }


def write_manifests(objects: Iterable[Mapping[str, Any]], out_dir: str | Path) -> list[Path]:
    """One file per object, numbered in creation order, so `kubectl apply -f DIR` works."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, obj in enumerate(objects):
        path = out / f"{i:02d}-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"
        path.write_text(yaml.safe_dump(dict(obj), sort_keys=False))
        paths.append(path)
    return paths


# --- the cluster side -----------------------------------------------------------------------


def _component(obj: Mapping[str, Any]) -> str:
    return obj["metadata"].get("labels", {}).get("app.kubernetes.io/component", "")


@dataclass
class KubernetesRun:
    """Creates the objects, gates on readiness, follows logs, and cleans up."""

    cfg: FlywheelConfig
    api_client: Any = None
    out: Callable[[str], None] = print
    poll_seconds: float = 2.0
    created: list[dict[str, Any]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _followers: dict[tuple[str, str], threading.Thread] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from kubernetes import client, config

        if self.api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config(config_file=self.cfg.scheduler.kubeconfig)
            self.api_client = client.ApiClient()
        self.core = client.CoreV1Api(self.api_client)
        self.apps = client.AppsV1Api(self.api_client)
        self.batch = client.BatchV1Api(self.api_client)
        self.networking = client.NetworkingV1Api(self.api_client)
        self.namespace = self.cfg.scheduler.namespace
        self.names = Names(self.cfg.scheduler.release_name, self.namespace)

    # -- create / delete ----------------------------------------------------------------
    def _create(self, obj: dict[str, Any]) -> bool:
        """Create one object; an existing one is left as is (False). Returns True if created."""
        from kubernetes.client.exceptions import ApiException

        kind, ns = obj["kind"], self.namespace
        # The client sends a dict body as it is (sanitize_for_serialization); its annotations
        # name only the generated model classes (V1Secret, ...).
        body: Any = obj
        calls: dict[str, Callable[[], Any]] = {
            "Namespace": lambda: self.core.create_namespace(body),
            "Secret": lambda: self.core.create_namespaced_secret(ns, body),
            "ConfigMap": lambda: self.core.create_namespaced_config_map(ns, body),
            "PersistentVolumeClaim": lambda: self.core.create_namespaced_persistent_volume_claim(
                ns, body
            ),
            "Service": lambda: self.core.create_namespaced_service(ns, body),
            "Deployment": lambda: self.apps.create_namespaced_deployment(ns, body),
            "StatefulSet": lambda: self.apps.create_namespaced_stateful_set(ns, body),
            "Job": lambda: self.batch.create_namespaced_job(ns, body),
            "NetworkPolicy": lambda: self.networking.create_namespaced_network_policy(ns, body),
        }
        try:
            calls[kind]()
        except ApiException as exc:
            if exc.status == 409 and kind in ("Namespace", "PersistentVolumeClaim"):
                return False  # a namespace or volume we did not create: use it, never delete it
            raise KubernetesLaunchError(
                f"creating {kind}/{obj['metadata']['name']} failed: {exc.status} {exc.reason}: {exc.body}"
            ) from exc
        self.created.append(obj)
        return True

    def _delete(self, obj: Mapping[str, Any]) -> None:
        from kubernetes.client.exceptions import ApiException

        kind, name, ns = obj["kind"], obj["metadata"]["name"], self.namespace
        calls: dict[str, Callable[[], Any]] = {
            "Namespace": lambda: self.core.delete_namespace(name),
            "Secret": lambda: self.core.delete_namespaced_secret(name, ns),
            "ConfigMap": lambda: self.core.delete_namespaced_config_map(name, ns),
            "PersistentVolumeClaim": lambda: self.core.delete_namespaced_persistent_volume_claim(
                name, ns
            ),
            "Service": lambda: self.core.delete_namespaced_service(name, ns),
            "Deployment": lambda: self.apps.delete_namespaced_deployment(
                name, ns, propagation_policy="Background"
            ),
            "StatefulSet": lambda: self.apps.delete_namespaced_stateful_set(
                name, ns, propagation_policy="Background"
            ),
            "Job": lambda: self.batch.delete_namespaced_job(
                name, ns, propagation_policy="Background"
            ),
            "NetworkPolicy": lambda: self.networking.delete_namespaced_network_policy(name, ns),
        }
        try:
            calls[kind]()
        except ApiException as exc:
            if exc.status != 404:
                log.warning("deleting %s/%s failed: %s", kind, name, exc.reason)

    def delete_created(self) -> None:
        """Delete what this run created, newest first; the shared volume is kept (it holds
        checkpoints and published weights)."""
        self._stop.set()
        for obj in reversed(self.created):
            if obj["kind"] == "PersistentVolumeClaim":
                continue
            self._delete(obj)
        self.created.clear()

    # -- readiness --------------------------------------------------------------------------
    def _ready(self, obj: Mapping[str, Any]) -> bool:
        name, want = obj["metadata"]["name"], obj["spec"].get("replicas", 1)
        if obj["kind"] == "Deployment":
            deployment = self.apps.read_namespaced_deployment_status(name, self.namespace).status
            ready = None if deployment is None else deployment.ready_replicas
        else:
            stateful = self.apps.read_namespaced_stateful_set_status(name, self.namespace).status
            ready = None if stateful is None else stateful.ready_replicas
        return (ready or 0) >= want

    def wait_ready(self, workloads: list[dict[str, Any]], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = list(workloads)
        while pending:
            self._check_pods()
            pending = [w for w in pending if not self._ready(w)]
            if not pending:
                return
            if time.monotonic() > deadline:
                raise KubernetesLaunchError(
                    f"not ready after {timeout:.0f} s: "
                    + ", ".join(f"{w['kind']}/{w['metadata']['name']}" for w in pending)
                )
            time.sleep(self.poll_seconds)

    # -- pods and logs ----------------------------------------------------------------------
    def _pods(self) -> list[Any]:
        selector = f"app.kubernetes.io/instance={self.cfg.scheduler.release_name}"
        return list(
            self.core.list_namespaced_pod(self.namespace, label_selector=selector).items or []
        )

    def _check_pods(self) -> dict[str, int | None]:
        """Start log followers for new containers; return exit codes of terminated trainer
        containers (by pod); raise when a pod is stuck in a crash loop or cannot pull."""
        exits: dict[str, int | None] = {}
        for pod in self._pods():
            pod_name = pod.metadata.name
            for cs in (pod.status.container_statuses or []) if pod.status else []:
                self._follow(pod_name, cs.name)
                waiting = cs.state.waiting if cs.state else None
                if waiting and waiting.reason in (
                    "ImagePullBackOff",
                    "ErrImagePull",
                    "CreateContainerConfigError",
                    "InvalidImageName",
                ):
                    raise KubernetesLaunchError(
                        f"pod {pod_name} container {cs.name}: {waiting.reason}: {waiting.message or ''}"
                    )
                if (
                    waiting
                    and waiting.reason == "CrashLoopBackOff"
                    and (cs.restart_count or 0) >= 3
                ):
                    raise KubernetesLaunchError(
                        f"pod {pod_name} container {cs.name} keeps crashing ({cs.restart_count} restarts)"
                    )
                term = (cs.state.terminated if cs.state else None) or (
                    cs.last_state.terminated if cs.last_state else None
                )
                if cs.name == "trainer" and term is not None:
                    exits[pod_name] = term.exit_code
        return exits

    def _follow(self, pod: str, container: str) -> None:
        key = (pod, container)
        if key in self._followers:
            return

        def pump() -> None:
            try:
                stream = self.core.read_namespaced_pod_log(
                    pod, self.namespace, container=container, follow=True, _preload_content=False
                )
                # With _preload_content=False the client returns the urllib3 response, not
                # the str its annotation names.
                for raw in stream.stream():  # type: ignore[attr-defined]
                    if self._stop.is_set():
                        break
                    for line in raw.decode(errors="replace").splitlines():
                        self.out(f"[{container} {pod}] {line}")
            except Exception as exc:  # noqa: BLE001 - a lost log stream must not end the run
                log.debug("log stream of %s/%s ended: %s", pod, container, exc)

        thread = threading.Thread(target=pump, name=f"logs-{pod}-{container}", daemon=True)
        self._followers[key] = thread
        thread.start()

    # -- the run ------------------------------------------------------------------------------
    def start(self, objects: list[dict[str, Any]]) -> None:
        """Create everything stage by stage, each gated on the previous stage's readiness."""
        timeout = self.cfg.launcher.startup_timeout
        kinds = ("Deployment", "StatefulSet", "Job")
        plain = [o for o in objects if o["kind"] not in kinds]
        for obj in plain:
            self._create(obj)
        workloads = [o for o in objects if o["kind"] in kinds]
        for stage in STAGES:
            batch = [w for w in workloads if _component(w) in stage]
            for w in batch:
                self._create(w)
            if stage == ("trainer",):
                return  # the trainer is watched to completion, not gated
            self.wait_ready(batch, timeout)
            if batch:
                self.out(f"ready: {', '.join(w['metadata']['name'] for w in batch)}")

    def wait_finished(self, timeout: float | None = None) -> int:
        """Until trainer pod 0 exits: its exit code (0 after total_train_steps)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            exits = self._check_pods()
            # Pod 0 of the trainer Job: named "<job>-0-<suffix>" (its hostname "<job>-0").
            job = self.names.of("trainer")
            pod0 = next((p for p in exits if p == f"{job}-0" or p.startswith(f"{job}-0-")), "")
            code = exits.get(pod0)
            if code is not None:
                # the trainer's last lines (its summary) are worth the wait
                for (_, container), thread in list(self._followers.items()):
                    if container == "trainer":
                        thread.join(timeout=5.0)
                return int(code)
            if deadline is not None and time.monotonic() > deadline:
                raise KubernetesLaunchError(f"trainer did not finish within {timeout:.0f} s")
            time.sleep(self.poll_seconds)

    def execute(self, objects: list[dict[str, Any]], timeout: float | None = None) -> int:
        try:
            self.start(objects)
            code = self.wait_finished(timeout)
            self.out(f"trainer exited with {code}")
            return code
        except KubernetesLaunchError as exc:
            self.out(f"error: {exc}")
            return 1
        except KeyboardInterrupt:
            self.out("interrupted: deleting the run's objects")
            return 130
        finally:
            self.delete_created()


def run(
    cfg: FlywheelConfig, *, dry_run_dir: str | Path | None = None, api_client: Any = None
) -> int:
    """Entry of `flywheel run` with `scheduler.type=kubernetes` (exit code)."""
    try:
        objects = build_manifests(cfg)
    except KubernetesLaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if dry_run_dir is not None:
        paths = write_manifests(objects, dry_run_dir)
        print(f"wrote {len(paths)} manifests to {dry_run_dir} (kubectl apply -f {dry_run_dir})")
        return 0
    return KubernetesRun(cfg, api_client=api_client).execute(objects)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m services.launcher.kubernetes", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--config", help="Flywheel YAML config")
    parser.add_argument(
        "--dry-run", metavar="DIR", help="write the manifests to DIR instead of creating them"
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.n_replicas=2")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, [*args.overrides, "scheduler.type=kubernetes"])
    return run(cfg, dry_run_dir=args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
