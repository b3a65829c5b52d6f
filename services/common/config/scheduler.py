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

    log_dir: str | None = None
    """Directory of service logs for local runs; null means
    `<cluster.fileroot>/<experiment>/<trial>/logs`."""
