"""A FlywheelConfig as values of the Helm chart `deploy/helm/flywheel/`.

`flywheel run scheduler.type=kubernetes` deploys the chart's topology: this module says
which chart values a run's config means, `helm_render` renders the chart with them, and
`kubernetes` applies the result. The chart derives every address, port and path of the
cluster itself (`flywheel.config` in its `_helpers.tpl`), so the `config` value is the run's
config without them, and without secrets: tokens, credentials and the Redis password go
into the chart's Secrets, the launching machine's TLS file paths stay on that machine.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

from services.common.config import FlywheelConfig
from services.common.config.services import ROLES

SHARED_MOUNT = "/data/shared"
"""The chart's `sharedStorage.mountPath` default; model and data sets must be under it."""

CALLER_ROLES = ("trainer", "rollout")
"""Components that call other services, each with its own role's token."""

TRAINER_SHM = "8Gi"
"""The trainer's /dev/shm: NCCL and the data loaders of several local ranks use it."""


class LaunchConfigError(ValueError):
    """The config cannot run on Kubernetes; the message says what to set."""


def check_runnable(cfg: FlywheelConfig) -> None:
    """Pods only read files: a model and data sets must already be on the shared volume;
    TLS on the launching machine needs a Secret for the pods."""
    if not cfg.actor.path:
        raise LaunchConfigError(
            "actor.path is empty: on Kubernetes the model must already be on the shared volume "
            f"(e.g. actor.path={SHARED_MOUNT}/models/<name>); the tiny demo model is written "
            "only by the local launcher"
        )
    if cfg.services.tls.client_enabled and not cfg.scheduler.tls_secret:
        raise LaunchConfigError(
            "services.tls is set on this machine, but the pods would serve plaintext: create a "
            "Secret with tls.crt, tls.key and ca.crt in the run's namespace (e.g. by "
            "cert-manager) and set scheduler.tls_secret=<its name>"
        )
    if not cfg.train_dataset.path:
        raise LaunchConfigError(
            "train_dataset.path is null: on Kubernetes the data set must be a file on the shared "
            f"volume (e.g. train_dataset.path={SHARED_MOUNT}/data/train.jsonl)"
        )


def role_tokens(cfg: FlywheelConfig, admin: str | None = None) -> dict[str, str]:
    """A token per role of `services.credentials`: the plain ones the config gives, else
    new ones; `admin` (or `services.auth_token`) as the admin's. A role the config gives
    only as a digest cannot be handed to a pod: generated anew unless it is a caller's."""
    given = {r: t for r, t in cfg.services.credentials.items() if not t.startswith("sha256:")}
    for role in CALLER_ROLES:
        if role in cfg.services.credentials and role not in given:
            raise LaunchConfigError(
                f"services.credentials.{role} is a digest: the {role} pods need the token itself"
            )
    tokens = {role: given.get(role) or secrets.token_hex(24) for role in ROLES}
    if admin or cfg.services.auth_token:
        tokens["admin"] = admin or cfg.services.auth_token or tokens["admin"]
    return tokens


def chart_config(cfg: FlywheelConfig) -> dict[str, Any]:
    """The chart's `config` value: `cfg` without what the chart derives for the cluster
    (service addresses, `cluster.fileroot`, the rendezvous address, the in-release Redis
    URL, SGLang's loopback URL), which the chart refuses in `config` unless equal to its
    own, and without secrets, which the services read from the environment the chart
    fills from its Secrets (`FLYWHEEL_TOKEN`, `FLYWHEEL_CREDENTIALS`,
    `FLYWHEEL_REDIS_PASSWORD`, `FLYWHEEL_TLS_*`). The ranks, replicas, backend and weight
    transport it keeps agree with the values `chart_values` sets."""
    data = cfg.model_dump(mode="json")
    services = data["services"]
    for key in ("auth_token", "credentials", "tls", "buffer", "reward", "rollout", "trainer"):
        services.pop(key, None)
    data["cluster"].pop("fileroot", None)
    for key in ("master_addr", "master_port"):
        data["trainer"].pop(key, None)
    for key in ("redis_url", "redis_password", "redis_server"):
        data["buffer"].pop(key, None)
    if _sglang_in_pod(cfg):
        data["rollout"]["sglang"].pop("url", None)
    return data


def _sglang_in_pod(cfg: FlywheelConfig) -> bool:
    """An SGLang server beside each rollout replica, unless the config names one."""
    return cfg.rollout.engine == "sglang" and not cfg.rollout.sglang.url


def _image(reference: str) -> dict[str, str]:
    """`repo[:tag]` or `repo@sha256:...` as the chart's `repository` and `tag`."""
    if "@" in reference:
        repository, digest = reference.split("@", 1)
        return {"repository": repository, "tag": digest}
    repository, _, tag = reference.rpartition(":")
    if not repository or "/" in tag:  # no tag, or the colon was a registry's port
        return {"repository": reference, "tag": "latest"}
    return {"repository": repository, "tag": tag}


def _sglang_args(launch_args: Mapping[str, Any]) -> tuple[float | None, list[str]]:
    """`rollout.sglang.launch_args` as `--key value` pairs; `mem_fraction_static` goes to
    its own chart value (the chart passes `--mem-fraction-static` itself)."""
    args = dict(launch_args)
    fraction = args.pop("mem_fraction_static", None)
    flat = [a for k, v in args.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    return (None if fraction is None else float(fraction)), flat


def chart_values(
    cfg: FlywheelConfig,
    *,
    admin_token: str | None = None,
    redis_password: str | None = None,
    sglang_api_key: str | None = None,
    shared_size: str = "100Gi",
    redis_size: str = "8Gi",
) -> dict[str, Any]:
    """The chart values of one run of `cfg`: every secret given (the launcher knows them,
    and a render never depends on what a cluster holds), one node of `trainer.n_ranks`
    local ranks, `rollout.n_replicas` replicas, no autoscaling, no dashboards or
    PodDisruptionBudgets (a run's objects are deleted when it ends), the trainer Job not
    retried (the launcher reports the failure; `flywheel run` again resumes)."""
    check_runnable(cfg)
    image = _image(cfg.scheduler.image)
    external_redis = cfg.buffer.redis_url
    if redis_password is None:
        redis_password = cfg.buffer.redis_password
    if redis_password is None and not external_redis:
        redis_password = secrets.token_hex(16)
    sglang = _sglang_in_pod(cfg)
    gpu_trainer = cfg.trainer.backend == "nccl"
    node_selector = dict(cfg.scheduler.node_selector)
    no_pdb = {"pdb": {"enabled": False}}

    values: dict[str, Any] = {
        "image": {**image, "pullPolicy": cfg.scheduler.image_pull_policy},
        "config": chart_config(cfg),
        "demo": {"enabled": False},
        "auth": {"enabled": True, "perService": True, "tokens": role_tokens(cfg, admin_token)},
        "sharedStorage": {"enabled": True, "size": shared_size, "mountPath": SHARED_MOUNT},
        "buffer": {"replicaCount": 1, **no_pdb},
        "reward": {"replicaCount": 1, "autoscaling": {"enabled": False}, **no_pdb},
        "rollout": {
            "replicaCount": cfg.rollout.n_replicas,
            "autoscaling": {"enabled": False},
            **no_pdb,
        },
        "trainer": {
            "nodes": 1,
            "nprocPerNode": cfg.trainer.n_ranks,
            "backend": cfg.trainer.backend,
            "weightTransport": cfg.trainer.weight_transport,
            "backoffLimit": 0,
            "shmSize": TRAINER_SHM,
            **no_pdb,
        },
        "metrics": {"enabled": False},
        "dashboards": {"enabled": False},
        "networkPolicy": {"enabled": True},
    }
    if external_redis:
        values["redis"] = {"enabled": False}
        values["externalRedis"] = {"url": external_redis, "password": redis_password or ""}
    else:
        values["redis"] = {
            "enabled": True,
            "auth": {"password": redis_password},
            "persistence": {"enabled": True, "size": redis_size},
            **no_pdb,
        }
    if gpu_trainer:
        values["trainer"]["resources"] = {"limits": {"nvidia.com/gpu": cfg.trainer.n_ranks}}
        if node_selector:
            values["trainer"]["nodeSelector"] = node_selector
    tp = cfg.rollout.sglang.tp_size
    fraction, extra_args = _sglang_args(cfg.rollout.sglang.launch_args)
    values["rollout"]["sglang"] = {"enabled": sglang}
    if sglang:
        values["rollout"]["sglang"].update(
            image=image,
            modelPath=cfg.actor.path,
            tpSize=tp,
            extraArgs=extra_args,
            resources={"limits": {"nvidia.com/gpu": tp}},
            apiKey={"enabled": True, "value": sglang_api_key or secrets.token_hex(24)},
        )
        if fraction is not None:
            values["rollout"]["sglang"]["memFractionStatic"] = fraction
        if node_selector:
            values["rollout"]["nodeSelector"] = node_selector
    if cfg.scheduler.tls_secret:
        tls = cfg.services.tls
        values["tls"] = {
            "enabled": True,
            "existingSecret": cfg.scheduler.tls_secret,
            "requireClientCert": tls.require_client_cert,
            "serverName": tls.server_name or "",
        }
    return values
