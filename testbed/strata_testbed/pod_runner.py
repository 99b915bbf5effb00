"""Runs the containers of Strata's pods as local processes, so the data plane the operator configured really runs.

kwok plays the kubelet for the fake GPU nodes: it binds pods and reports them Running, and (with the test bed's
pod CIDR on 127.0.0.0/8) gives each one an address that is local to this machine. This runner does the rest of a
kubelet's job for Strata's pods: for each Running pod it resolves the container's environment the way the
kubelet does (downward-API fields, Secret keys, `$(VAR)` references), starts the container's command with it, and
stops the process when the pod goes away. It runs what the operator generated, with one exception: the GPUs are
kwok's fiction, so STRATA_DEVICE becomes `cpu` (the torch code path is the same on either device).
"""

from __future__ import annotations

import base64
import os
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from kubernetes import client

from strata_testbed.processes import ManagedProcess

MANAGED_BY = "app.kubernetes.io/managed-by=strata-operator"
_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


class PodSpecError(Exception):
    """A pod asks for something the runner cannot provide (a field or Secret key that does not exist)."""


def _field(pod: client.V1Pod, path: str) -> str:
    values = {
        "status.podIP": pod.status.pod_ip,
        "metadata.name": pod.metadata.name,
        "metadata.namespace": pod.metadata.namespace,
        "spec.nodeName": pod.spec.node_name,
    }
    value = values.get(path)
    if value is None:
        raise PodSpecError(f"pod {pod.metadata.name}: downward-API field {path} is not available")
    return str(value)


def container_env(pod: client.V1Pod, container: client.V1Container, core: client.CoreV1Api) -> dict[str, str]:
    """The environment the kubelet would give the container, in declaration order."""
    env: dict[str, str] = {}
    for var in container.env or []:
        if var.value_from is None:
            raw = var.value or ""
            env[var.name] = _REFERENCE.sub(lambda m: env.get(m.group(1), m.group(0)), raw)
        elif var.value_from.field_ref is not None:
            env[var.name] = _field(pod, var.value_from.field_ref.field_path)
        elif var.value_from.secret_key_ref is not None:
            ref = var.value_from.secret_key_ref
            secret = core.read_namespaced_secret(name=ref.name, namespace=pod.metadata.namespace)
            if ref.key not in (secret.data or {}):
                raise PodSpecError(f"pod {pod.metadata.name}: Secret {ref.name} has no key {ref.key}")
            env[var.name] = base64.b64decode(secret.data[ref.key]).decode()
        else:
            raise PodSpecError(f"pod {pod.metadata.name}: env {var.name} uses an unsupported source")
    return env


@dataclass
class _Running:
    uid: str
    process: ManagedProcess


class PodRunner:
    """Poll the API for Strata's pods and keep one local process per Running pod."""

    def __init__(self, *, core: client.CoreV1Api, namespace: str, log_dir: Path, poll_seconds: float = 0.5) -> None:
        self._core = core
        self._namespace = namespace
        self._log_dir = log_dir
        self._poll = poll_seconds
        self._running: dict[str, _Running] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pod-runner", daemon=True)
        self.errors: list[str] = []

    def __enter__(self) -> PodRunner:
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        for entry in self._running.values():
            entry.process.stop()
        self._running.clear()

    def processes(self) -> dict[str, ManagedProcess]:
        return {name: entry.process for name, entry in self._running.items()}

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except Exception as e:  # the runner keeps going; the test reads `errors`
                self.errors.append(repr(e))
            self._stop.wait(self._poll)

    def sync(self) -> None:
        pods = self._core.list_namespaced_pod(namespace=self._namespace, label_selector=MANAGED_BY).items
        live = {
            p.metadata.name: p
            for p in pods
            if p.status.phase == "Running" and p.status.pod_ip and p.metadata.deletion_timestamp is None
        }
        for name in list(self._running):
            if name not in live or live[name].metadata.uid != self._running[name].uid:
                self._running.pop(name).process.stop()
        for name, pod in live.items():
            if name not in self._running:
                self._running[name] = _Running(uid=pod.metadata.uid, process=self._start(pod))

    def _start(self, pod: client.V1Pod) -> ManagedProcess:
        container = pod.spec.containers[0]
        env = container_env(pod, container, self._core)
        if "STRATA_DEVICE" in env:
            env["STRATA_DEVICE"] = "cpu"
        argv = [*(container.command or []), *(container.args or [])]
        # The image's `strata` is this environment's console script.
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        return ManagedProcess(name=pod.metadata.name, argv=argv, log_dir=self._log_dir, env={**env, "PATH": path})
