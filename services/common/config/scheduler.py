"""Scheduler block: local processes or Kubernetes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ._base import FlywheelModel


class SchedulerConfig(FlywheelModel):
    """Where the launcher puts the services."""

    type: Literal["local", "kubernetes"] = "local"
    """`local`: child processes of the launcher; `kubernetes`: pods via the Helm chart."""

    namespace: str = "flywheel"
    """Kubernetes namespace."""

    release_name: str = "flywheel"
    """Helm release name."""

    image: str = "flywheel:latest"
    """Container image of the services."""

    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """Kubernetes image pull policy."""

    kubeconfig: str | None = None
    """kubeconfig file; null uses in-cluster config or `~/.kube/config`."""

    node_selector: dict[str, str] = Field(default_factory=dict)
    """Kubernetes node selector of GPU pods; free-form."""

    tls_secret: str | None = None
    """Kubernetes only: a Secret in `namespace` with `tls.crt`, `tls.key` and `ca.crt`
    (cert-manager's layout) that turns on TLS for every service of the run: each pod mounts
    it and gets `FLYWHEEL_TLS_*` (plus `require_client_cert` and `server_name` of
    `services.tls`), and the gRPC probes become HTTP `/readyz` (the kubelet's gRPC probe
    speaks plaintext only). Required when `services.tls` is set on the launching machine, so
    that a run meant to be encrypted never starts in plaintext; null: plaintext gRPC."""

    log_dir: str | None = None
    """Directory of service logs for local runs; null means
    `<cluster.fileroot>/<experiment>/<trial>/logs`."""
