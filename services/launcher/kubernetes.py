"""`flywheel run scheduler.type=kubernetes`: the same topology as a local run, as pods.

The topology is the Helm chart's (`deploy/helm/flywheel/`), the one description of it: the
launcher turns the run's config into chart values (`k8s_values.chart_values`), renders the
chart with a real Helm engine (`helm_render`: the `helm` binary, else helm-python-sdk),
and applies what it renders with the `kubernetes` client: the namespace, the chart's
NetworkPolicies (before any pod exists), its ServiceAccount, Secrets (a token per caller
role and their digests, the Redis password, SGLang's API key), the ConfigMap with
`flywheel.yaml`, the shared volume for checkpoints and published weights, Redis as a
StatefulSet with AOF (unless `buffer.redis_url` points at an existing Redis), the buffer and
reward as Deployments, the rollout replicas as a StatefulSet (replica i is pod i), and the
trainer as an Indexed Job of one pod whose supervisor runs `trainer.n_ranks` local ranks.
It waits for each stage to be ready in the order the local launcher uses (Redis, then
buffer and reward, then rollout, then trainer), follows every container's logs, and
deletes what it created when the trainer finishes, when a pod fails for good, or on Ctrl-C.

`--dry-run DIR` writes the rendered objects to a folder instead (`kubectl apply -f DIR`
applies them in order); `--values FILE` adds chart values over the derived ones
(resources, tolerations, ...). Multi-node trainers and autoscaling are `helm install`'s job.

    python -m services.launcher.kubernetes --config run.yaml [overrides] [--dry-run DIR]
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pydantic
import yaml

from services.common.config import FlywheelConfig, load_config
from services.launcher.helm_render import HelmRenderError, render_chart
from services.launcher.k8s_values import LaunchConfigError, chart_values

log = logging.getLogger("flywheel.launcher.kubernetes")

# Start order: each stage must be ready before the next starts (as the local launcher).
STAGES: tuple[tuple[str, ...], ...] = (("redis",), ("buffer", "reward"), ("rollout",), ("trainer",))
WORKLOADS = ("Deployment", "StatefulSet", "Job")
# Creation order of everything else: no pod ever runs unconfined by its NetworkPolicy, and
# every Secret, ConfigMap and volume a pod reads exists before it.
PLAIN_ORDER = (
    "Namespace",
    "NetworkPolicy",
    "ServiceAccount",
    "Secret",
    "ConfigMap",
    "PersistentVolumeClaim",
    "Service",
)


class KubernetesLaunchError(RuntimeError):
    """The cluster run cannot start or failed; the message says which object and why."""


def _component(obj: Mapping[str, Any]) -> str:
    return obj["metadata"].get("labels", {}).get("app.kubernetes.io/component", "")


def _stage(obj: Mapping[str, Any]) -> int:
    return next((i for i, s in enumerate(STAGES) if _component(obj) in s), len(STAGES))


def creation_order(objects: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Plain objects by PLAIN_ORDER, then the workloads stage by stage (stable otherwise)."""

    def key(obj: Mapping[str, Any]) -> tuple[int, int]:
        if obj["kind"] in WORKLOADS:
            return len(PLAIN_ORDER), _stage(obj)
        kind = obj["kind"]
        return (PLAIN_ORDER.index(kind) if kind in PLAIN_ORDER else len(PLAIN_ORDER) - 1), 0

    return sorted(objects, key=key)


def manifests(
    cfg: FlywheelConfig,
    *,
    extra_values: Mapping[str, Any] | None = None,
    **secrets: Any,
) -> list[dict[str, Any]]:
    """Every object of the run, in creation order: the namespace, then what the chart
    renders for `chart_values(cfg, **secrets)` (with `extra_values` merged over them).
    The ConfigMap's `flywheel.yaml` must load here, as every pod will load it."""
    values = _merged(chart_values(cfg, **secrets), extra_values or {})
    release, namespace = cfg.scheduler.release_name, cfg.scheduler.namespace
    rendered = render_chart(values, release=release, namespace=namespace)
    for obj in rendered:
        text = (obj.get("data") or {}).get("flywheel.yaml") if obj["kind"] == "ConfigMap" else None
        if text is not None:
            try:
                FlywheelConfig.model_validate(yaml.safe_load(text))
            except pydantic.ValidationError as exc:
                raise LaunchConfigError(
                    f"the chart's flywheel.yaml ({obj['metadata']['name']}) does not load: {exc}"
                ) from exc
    namespace_obj = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": namespace,
            "labels": {
                "app.kubernetes.io/instance": release,
                "app.kubernetes.io/part-of": "flywheel",
            },
        },
    }
    return creation_order([namespace_obj, *rendered])


def _merged(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """`extra` over `base`, maps merged key by key (as Helm merges `-f` files)."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


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
        self.trainer_job = ""  # the chart's Job name carries its revision hash

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
            "ServiceAccount": lambda: self.core.create_namespaced_service_account(ns, body),
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
        if kind not in calls:
            raise KubernetesLaunchError(
                f"{kind}/{obj['metadata']['name']}: the launcher cannot create a {kind} "
                f"(it creates {', '.join(calls)}); leave it out of the chart values"
            )
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
            "ServiceAccount": lambda: self.core.delete_namespaced_service_account(name, ns),
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
            calls[kind]()  # only kinds _create accepted were created
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
        plain = [o for o in objects if o["kind"] not in WORKLOADS]
        for obj in plain:
            self._create(obj)
        workloads = [o for o in objects if o["kind"] in WORKLOADS]
        self.trainer_job = next(
            (
                w["metadata"]["name"]
                for w in workloads
                if w["kind"] == "Job" and _component(w) == "trainer"
            ),
            self.trainer_job,
        )
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
            job = self.trainer_job
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
    cfg: FlywheelConfig,
    *,
    dry_run_dir: str | Path | None = None,
    api_client: Any = None,
    extra_values: Mapping[str, Any] | None = None,
) -> int:
    """Entry of `flywheel run` with `scheduler.type=kubernetes` (exit code)."""
    try:
        objects = manifests(cfg, extra_values=extra_values)
    except (LaunchConfigError, HelmRenderError) as exc:
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
        "--dry-run", metavar="DIR", help="write the rendered chart to DIR instead of applying it"
    )
    parser.add_argument(
        "--values",
        metavar="FILE",
        action="append",
        default=[],
        help="chart values merged over those derived from the config (repeatable)",
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.n_replicas=2")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, [*args.overrides, "scheduler.type=kubernetes"])
    extra: dict[str, Any] = {}
    for path in args.values:
        extra = _merged(extra, yaml.safe_load(Path(path).read_text()) or {})
    return run(cfg, dry_run_dir=args.dry_run, extra_values=extra)


if __name__ == "__main__":
    sys.exit(main())
