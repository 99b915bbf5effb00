"""Runs the containers of Strata's pods as local processes, so what the operator and the chart configured really runs.

kwok plays the kubelet for the fake GPU nodes: it binds pods and reports them Running, and (with the test bed's
pod CIDR on 127.0.0.0/8) gives each one an address that is local to this machine. This runner does the rest of a
kubelet's job for Strata's pods (the chart's operator, the stages, the gateway): for each Running pod it resolves
the container's environment the way the kubelet does (downward-API fields, Secret keys, `$(VAR)` references, the
API server's address), starts the container's command in a sandbox that gives it the pod's /etc/hosts and
ServiceAccount token (pod_sandbox), runs the container's readiness probe and writes the pod's Ready condition
from it, restarts a process that exits, and stops it when the pod goes away.

It runs what was generated, with two exceptions, both because these processes share the host's network and
hardware: a listen address on every interface (`0.0.0.0:PORT`) becomes the pod's own IP, as a pod's network
namespace would make it; and the GPUs are kwok's fiction, so STRATA_DEVICE becomes `cpu` (the torch code path is
the same on either device).
"""

from __future__ import annotations

import base64
import datetime as dt
import os
import re
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from kubernetes import client

from strata_testbed.pod_sandbox import (
    HostsFile,
    ServiceAccountFiles,
    check_sandbox,
    mounts_token,
    pod_dns_names,
    start_in_sandbox,
)
from strata_testbed.probes import Readiness
from strata_testbed.processes import ManagedProcess

if TYPE_CHECKING:
    from strata_testbed.controlplane import ControlPlane

# Every pod of Strata's, the chart's operator and each ModelDeployment's children alike.
STRATA_PODS = "app.kubernetes.io/name=strata"
# The image's ENTRYPOINT, for containers that give only args (the chart's operator).
IMAGE_ENTRYPOINT = ["strata"]
RESTART_BACKOFF_S = 2.0
_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_EVERY_INTERFACE = re.compile(r"\b0\.0\.0\.0:(\d+)\b")


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


def expand(text: str, env: dict[str, str]) -> str:
    """`$(VAR)` references to variables defined so far; an unknown one stays as written, as the kubelet leaves it."""
    return _REFERENCE.sub(lambda m: env.get(m.group(1), m.group(0)), text)


def container_env(pod: client.V1Pod, container: client.V1Container, core: client.CoreV1Api) -> dict[str, str]:
    """The environment the kubelet would give the container, in declaration order."""
    env: dict[str, str] = {}
    for var in container.env or []:
        if var.value_from is None:
            env[var.name] = expand(var.value or "", env)
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
    argv: list[str]
    env: dict[str, str]
    account: ServiceAccountFiles | None  # the token folder, where the pod mounts one
    readiness: Readiness
    reported: bool
    exited_at: float | None = None

    @property
    def token(self) -> Path | None:
        return None if self.account is None else self.account.folder


class PodRunner:
    """Poll the API for Strata's pods and keep one local process per Running pod, with its readiness reported."""

    def __init__(
        self,
        *,
        core: client.CoreV1Api,
        log_dir: Path,
        api_server: str,
        ca: Path,
        namespaces: Sequence[str] = (),
        poll_seconds: float = 0.5,
        node_env: Mapping[str, str] | None = None,
    ) -> None:
        """`namespaces`: where to look for pods; every namespace when empty. `node_env`: variables every container
        gets beneath its own, as a node's runtime may add them (a test injects stage faults this way)."""
        check_sandbox()
        self._core = core
        self._namespaces = list(namespaces)
        self._log_dir = log_dir
        self._api = urlsplit(api_server)
        self._ca = ca
        self._poll = poll_seconds
        self._node_env = dict(node_env or {})
        self._running: dict[str, _Running] = {}
        log_dir.mkdir(parents=True, exist_ok=True)
        self._hosts = HostsFile(log_dir / "hosts")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pod-runner", daemon=True)
        self.errors: list[str] = []

    def __enter__(self) -> PodRunner:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        for entry in self._running.values():
            entry.process.stop()
        self._running.clear()

    def processes(self) -> dict[str, ManagedProcess]:
        """Running processes by pod key (`namespace/name`)."""
        return {key: entry.process for key, entry in self._running.items()}

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except Exception as e:  # the runner keeps going; a test or the demo reads `errors`
                self.errors.append(repr(e))
            self._stop.wait(self._poll)

    def _pods(self) -> list[client.V1Pod]:
        if not self._namespaces:
            return list(self._core.list_pod_for_all_namespaces(label_selector=STRATA_PODS).items)
        pods: list[client.V1Pod] = []
        for namespace in self._namespaces:
            pods += self._core.list_namespaced_pod(namespace=namespace, label_selector=STRATA_PODS).items
        return pods

    def sync(self) -> None:
        live = {
            f"{p.metadata.namespace}/{p.metadata.name}": p
            for p in self._pods()
            if p.status.phase == "Running" and p.status.pod_ip and p.metadata.deletion_timestamp is None
        }
        self._hosts.update({p.status.pod_ip: [*pod_dns_names(p), p.metadata.name] for p in live.values()})
        for key in list(self._running):
            if key not in live or live[key].metadata.uid != self._running[key].uid:
                self._running.pop(key).process.stop()
        for key, pod in live.items():
            if key not in self._running:
                self._running[key] = self._start(key, pod)
        for key, entry in self._running.items():
            self._keep_running(key, entry)
            if entry.account is not None:
                entry.account.refresh(self._core, ca=self._ca)
            self._report(key, entry, ready=entry.process.running() and entry.readiness.check())

    def _keep_running(self, key: str, entry: _Running) -> None:
        """restartPolicy Always, with a fixed back-off: an exited container is started again."""
        if entry.process.running():
            return
        now = time.monotonic()
        if entry.exited_at is None:
            entry.exited_at = now
            self.errors.append(f"{key} exited; its log ends:\n{entry.process.log_tail(20)}")
        if now - entry.exited_at < RESTART_BACKOFF_S:
            return
        entry.process.stop()
        entry.process = self._spawn(key, argv=entry.argv, env=entry.env, token=entry.token)
        entry.exited_at = None

    def _report(self, key: str, entry: _Running, *, ready: bool) -> None:
        """Write the pod's readiness when it differs from what was last written."""
        if entry.reported is not ready:
            self._write_ready(key, container=entry.readiness.container.name, ready=ready)
            entry.reported = ready

    def _write_ready(self, key: str, *, container: str, ready: bool) -> None:
        """The pod's Ready and ContainersReady conditions and its container's ready flag, as the kubelet writes them."""
        namespace, name = key.split("/", 1)
        value = "True" if ready else "False"
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        kinds = ("Ready", "ContainersReady")
        conditions = [{"type": kind, "status": value, "lastTransitionTime": now} for kind in kinds]
        # A merge patch replaces lists whole: send every container status as it is, with only `ready` changed.
        current = self._core.read_namespaced_pod_status(name=name, namespace=namespace)
        serialize = self._core.api_client.sanitize_for_serialization
        statuses = [serialize(c) for c in current.status.container_statuses or []]
        for entry in statuses:
            if entry["name"] == container:
                entry["ready"] = ready
        status = {"conditions": conditions, "containerStatuses": statuses}
        self._core.patch_namespaced_pod_status(name=name, namespace=namespace, body={"status": status})

    def _start(self, key: str, pod: client.V1Pod) -> _Running:
        container = pod.spec.containers[0]
        ip = pod.status.pod_ip
        env = {
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "HOME": str(self._log_dir / "home"),
            "HOSTNAME": pod.metadata.name,
            # The kubelet gives every container the API server's address; with the token this is in-cluster config.
            "KUBERNETES_SERVICE_HOST": self._api.hostname or "",
            "KUBERNETES_SERVICE_PORT": str(self._api.port or 443),
        }
        # The image's Python packages are this environment's; a checkout run with PYTHONPATH passes it on.
        if "PYTHONPATH" in os.environ:
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        env |= self._node_env
        env |= container_env(pod, container, self._core)
        if "STRATA_DEVICE" in env:
            env["STRATA_DEVICE"] = "cpu"
        env = {name: _EVERY_INTERFACE.sub(rf"{ip}:\1", value) for name, value in env.items()}
        argv = [expand(part, env) for part in [*(container.command or IMAGE_ENTRYPOINT), *(container.args or [])]]
        argv = [_EVERY_INTERFACE.sub(rf"{ip}:\1", part) for part in argv]
        account: ServiceAccountFiles | None = None
        if mounts_token(pod, self._core):
            account = ServiceAccountFiles(
                folder=self._log_dir / "tokens" / key.replace("/", "_"),
                namespace=pod.metadata.namespace,
                account=pod.spec.service_account_name or "default",
                pod=pod.metadata.name,
                pod_uid=pod.metadata.uid,
            )
            account.refresh(self._core, ca=self._ca)
        readiness = Readiness(probe=container.readiness_probe, container=container, pod_ip=ip)
        # kwok reported the pod ready the moment it bound it; until the probe passes, it is not.
        self._write_ready(key, container=container.name, ready=False)
        return _Running(
            uid=pod.metadata.uid,
            process=self._spawn(key, argv=argv, env=env, token=None if account is None else account.folder),
            argv=argv,
            env=env,
            account=account,
            readiness=readiness,
            reported=False,
        )

    def _spawn(self, key: str, *, argv: list[str], env: dict[str, str], token: Path | None) -> ManagedProcess:
        (self._log_dir / "home").mkdir(parents=True, exist_ok=True)
        return start_in_sandbox(
            name=key.replace("/", "_"),
            argv=argv,
            env=env,
            hosts=self._hosts,
            token=token,
            log_dir=self._log_dir,
        )


def namespace_runner(
    control_plane: ControlPlane,
    *,
    core: client.CoreV1Api,
    namespace: str,
    folder: Path,
    node_env: Mapping[str, str] | None = None,
) -> PodRunner:
    """A runner for the pods of one namespace of `control_plane`, their logs under `folder`/pods: how the cluster
    tests run Strata's pods."""
    return PodRunner(
        core=core,
        namespaces=[namespace],
        log_dir=folder / "pods",
        api_server=control_plane.server,
        ca=control_plane.pki.ca.cert,
        node_env=node_env,
    )
