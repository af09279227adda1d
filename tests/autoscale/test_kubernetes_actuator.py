"""The Kubernetes actuator against a small HTTP server speaking the apps/v1
``deployments/scale`` subresource, so the real ``kubernetes`` client's calls
(paths, verbs, patch content type, body) are what is checked."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import kubernetes
import pytest

from octavo.autoscale.actuators.kubernetes import KubernetesActuator, KubernetesConfig

SCALE_PATH = "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale"
MERGE_TYPES = ("application/merge-patch+json", "application/strategic-merge-patch+json")


class FakeApiServer:
    """One Deployment's scale subresource: GET returns an autoscaling/v1 Scale,
    PATCH applies a merge patch of spec.replicas; anything else is 404/415."""

    def __init__(self, namespace: str, name: str, replicas: int) -> None:
        self.path = SCALE_PATH.format(ns=namespace, name=name)
        self.namespace, self.name = namespace, name
        self.replicas = replicas
        self.calls: list[tuple[str, str, str, object]] = []  # (verb, path, content type, body)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                server.calls.append(("GET", self.path, "", None))
                if self.path != server.path:
                    return self._send(404, {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404})
                self._send(200, server.scale())

            def do_PATCH(self) -> None:
                length = int(self.headers["Content-Length"])
                body = json.loads(self.rfile.read(length))
                ctype = self.headers["Content-Type"]
                server.calls.append(("PATCH", self.path, ctype, body))
                if self.path != server.path:
                    return self._send(404, {"kind": "Status", "code": 404})
                if ctype not in MERGE_TYPES or not isinstance(body, dict):
                    return self._send(415, {"kind": "Status", "code": 415})
                server.replicas = int(body["spec"]["replicas"])
                self._send(200, server.scale())

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def scale(self) -> dict:
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": {"replicas": self.replicas},
                "status": {"replicas": self.replicas, "selector": "app=octavo"}}

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def apiserver() -> Iterator[FakeApiServer]:
    server = FakeApiServer("serving", "octavo", replicas=2)
    yield server
    server.close()


def _api(url: str):
    configuration = kubernetes.client.Configuration()
    configuration.host = url
    return kubernetes.client.AppsV1Api(kubernetes.client.ApiClient(configuration))


def test_reads_and_patches_the_scale_subresource(apiserver):
    actuator = KubernetesActuator(KubernetesConfig(deployment="octavo", namespace="serving"), _api(apiserver.url))
    assert actuator.replicas() == 2
    actuator.scale(5)
    assert apiserver.replicas == 5
    assert actuator.replicas() == 5 and actuator.ready_replicas() == 5
    patch = [c for c in apiserver.calls if c[0] == "PATCH"]
    assert len(patch) == 1
    verb, path, ctype, body = patch[0]
    assert path == "/apis/apps/v1/namespaces/serving/deployments/octavo/scale"
    assert ctype in MERGE_TYPES
    assert body == {"spec": {"replicas": 5}}  # only the count: other managers keep their fields
    actuator.scale(0)
    assert apiserver.replicas == 0
    actuator.close()


def test_a_missing_deployment_is_the_clients_error(apiserver):
    actuator = KubernetesActuator(KubernetesConfig(deployment="nope", namespace="serving"), _api(apiserver.url))
    with pytest.raises(kubernetes.client.ApiException) as info:
        actuator.replicas()
    assert info.value.status == 404
    with pytest.raises(ValueError, match="kubernetes.deployment"):
        KubernetesActuator(KubernetesConfig(), _api(apiserver.url))
    with pytest.raises(ValueError, match="replicas"):
        KubernetesActuator(KubernetesConfig(deployment="octavo", namespace="serving"), _api(apiserver.url)).scale(-1)
