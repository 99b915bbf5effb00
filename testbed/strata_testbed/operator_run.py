"""The operator as its own process on the test bed, and the ModelDeployment reads tests and benches make of it.

The operator runs as `strata operator`, exactly as in a cluster; these helpers create a ModelDeployment, read it
back, and say when its plan's stage pods all run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kubernetes import client
from strata.operator.names import LABEL_GENERATION, LABEL_INSTANCE
from strata.operator.spec import GROUP, PLURAL, VERSION


class OperatorProcess:
    def __init__(self, kubeconfig: Path, namespace: str, log: Path, *, env: Mapping[str, str] | None = None) -> None:
        self._argv = [
            sys.executable,
            "-m",
            "strata.cli",
            "operator",
            "--kubeconfig",
            str(kubeconfig),
            "--namespace",
            namespace,
            "--lease-namespace",
            namespace,
            "--image",
            "strata:test",
        ]
        self._log = log
        self._env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        handle = self._log.open("ab")
        self.proc = subprocess.Popen(self._argv, stdout=handle, stderr=subprocess.STDOUT, env=self._env)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


def deployment(name: str, model: Path, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ModelDeployment",
        "metadata": {"name": name},
        "spec": {"model": {"url": model.as_uri()}, **spec},
    }


def read(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    return dict(
        client.CustomObjectsApi(api).get_namespaced_custom_object(
            group=GROUP, version=VERSION, namespace=namespace, plural=PLURAL, name=name
        )
    )


def condition(body: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for c in (body.get("status") or {}).get("conditions", []):
        if c["type"] == kind:
            return dict(c)
    return None


def stage_pods(api: client.ApiClient, namespace: str, name: str) -> list[client.V1Pod]:
    pods = (
        client.CoreV1Api(api)
        .list_namespaced_pod(
            namespace=namespace, label_selector=f"{LABEL_INSTANCE}={name},app.kubernetes.io/component=stage"
        )
        .items
    )
    return sorted(pods, key=lambda p: p.metadata.name)


def create(api: client.ApiClient, namespace: str, body: dict[str, Any]) -> None:
    client.CustomObjectsApi(api).create_namespaced_custom_object(
        group=GROUP, version=VERSION, namespace=namespace, plural=PLURAL, body=body
    )


def planned_and_running(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any] | None:
    body = read(api, namespace, name)
    plan = (body.get("status") or {}).get("plan")
    if not plan:
        return None
    pods = stage_pods(api, namespace, name)
    current = [p for p in pods if p.metadata.labels.get(LABEL_GENERATION) == str(plan["generation"])]
    if len(current) != len(plan["stages"]) or any(p.status.phase != "Running" for p in current):
        return None
    return body
