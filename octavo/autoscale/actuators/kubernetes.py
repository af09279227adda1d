"""A Kubernetes Deployment scaled through its ``scale`` subresource with the
official ``kubernetes`` client (extra ``octavo[autoscale]``).

Only ``spec.replicas`` is written, as HPA does, so whatever else manages the
Deployment (kubectl apply, Helm, Argo) keeps its fields. Draining is the
pods' own business: Kubernetes removes a terminating pod from the Service's
endpoints and sends SIGTERM, on which ``octavo serve`` finishes its open
requests within --shutdown-timeout (set terminationGracePeriodSeconds above
it). Do not run this and an HPA on the same Deployment: they would fight.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from octavo.autoscale.actuators.base import Actuator
from octavo.config import option

logger = logging.getLogger(__name__)


@dataclass
class KubernetesConfig:
    deployment: Optional[str] = option(None, "the Deployment to scale")
    namespace: str = option("default", "its namespace")
    kubeconfig: Optional[str] = option(None, "kubeconfig file (default: in-cluster service account, "
                                             "else ~/.kube/config)")
    context: Optional[str] = option(None, "kubeconfig context (default: the current one)")


def load_api(config: KubernetesConfig) -> Any:
    """An ``AppsV1Api`` from the kubeconfig or the pod's service account."""
    from kubernetes import client, config as kube_config

    if config.kubeconfig is not None:
        kube_config.load_kube_config(config_file=config.kubeconfig, context=config.context)
    else:
        try:
            kube_config.load_incluster_config()
        except kube_config.ConfigException:
            kube_config.load_kube_config(context=config.context)
    return client.AppsV1Api()


class KubernetesActuator(Actuator):
    """``api``: an ``kubernetes.client.AppsV1Api`` (``load_api`` builds one)."""

    def __init__(self, config: KubernetesConfig, api: Any) -> None:
        if not config.deployment:
            raise ValueError("kubernetes.deployment: the Deployment to scale is required")
        self.config = config
        self._api = api

    def replicas(self) -> int:
        scale = self._api.read_namespaced_deployment_scale(self.config.deployment, self.config.namespace)
        return int(scale.spec.replicas or 0)

    def ready_replicas(self) -> int:
        """Pods the Deployment's status counts (the scale subresource's ``status.replicas``)."""
        scale = self._api.read_namespaced_deployment_scale(self.config.deployment, self.config.namespace)
        return int(scale.status.replicas or 0)

    def scale(self, replicas: int) -> None:
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        self._api.patch_namespaced_deployment_scale(
            self.config.deployment, self.config.namespace, {"spec": {"replicas": replicas}})
        logger.info("deployment %s/%s scaled to %d", self.config.namespace, self.config.deployment, replicas)

    def close(self) -> None:
        self._api.api_client.close()
