"""A container's readiness probe, run the way the kubelet runs it, against a pod process on its pod IP.

The probes are the ones the operator (or the chart) wrote into the pod spec: gRPC health checks for stages, HTTP
GETs for the gateway. A container without a readiness probe is ready once it runs, as in Kubernetes.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kubernetes import client

TIMEOUT_S = 1.0


def _port(container: client.V1Container, port: int | str) -> int:
    """A probe's port, by number or by the name of one of the container's ports."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for declared in container.ports or []:
        if declared.name == port:
            return int(declared.container_port)
    raise ValueError(f"container {container.name} declares no port named {port!r}")


def _grpc_serving(address: str, service: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S
            )
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:  # noqa: S310 - a pod IP we were given
            return 200 <= int(response.status) < 400
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def probe_passes(probe: client.V1Probe, *, container: client.V1Container, pod_ip: str) -> bool:
    if probe.grpc is not None:
        return _grpc_serving(f"{pod_ip}:{_port(container, probe.grpc.port)}", probe.grpc.service or "")
    if probe.http_get is not None:
        path = probe.http_get.path or "/"
        return _http_ok(f"http://{pod_ip}:{_port(container, probe.http_get.port)}{path}")
    raise ValueError(f"container {container.name}: only gRPC and HTTP readiness probes are run by the test bed")


@dataclass
class Readiness:
    """One container's readiness, re-probed every periodSeconds."""

    probe: client.V1Probe | None
    container: client.V1Container
    pod_ip: str
    ready: bool = False
    _next: float = 0.0

    def check(self) -> bool:
        """Probe if one is due; the readiness as of now."""
        if self.probe is None:
            self.ready = True
            return True
        now = time.monotonic()
        if now >= self._next:
            self.ready = probe_passes(self.probe, container=self.container, pod_ip=self.pod_ip)
            # Until it first passes, probe every half second: the pod's start-up is what a person waits on.
            self._next = now + (float(self.probe.period_seconds or 10) if self.ready else 0.5)
        return self.ready
