"""A real Kubernetes control plane on loopback: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok.

The binaries come from testbed/build-binaries.sh (built from the Go module proxy and cached by their pins). Ports
are free ones picked at start, certificates are generated per run, and `stop()` (or leaving the `with` block) ends
every process; the children also die with their parent, so a killed test run leaves nothing behind.
"""

from __future__ import annotations

import copy
import secrets
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import yaml

from strata_testbed.pki import OPERATOR_USER, CertPair, ClusterPKI, create_pki
from strata_testbed.processes import ManagedProcess

TESTBED_DIR = Path(__file__).resolve().parent.parent
SERVICE_CIDR = "10.0.0.0/24"
KWOK_MANAGED_ANNOTATION = "kwok.x-k8s.io/node"


# What kwok's pinned pod-ready template says of readiness, and what a kubelet says before a probe passes.
_UNREADY = [
    ('status: "True"\n  type: Ready\n', 'status: "False"\n  type: Ready\n'),
    ('status: "True"\n  type: ContainersReady\n', 'status: "False"\n  type: ContainersReady\n'),
    ("name: {{ .name | Quote }}\n  ready: true", "name: {{ .name | Quote }}\n  ready: false"),
]


class ControlPlaneError(RuntimeError):
    """A component failed to build, start or become ready; the message carries its log tail."""


def binaries_dir() -> Path:
    """The cached folder of pinned binaries, built on first use."""
    result = subprocess.run([str(TESTBED_DIR / "build-binaries.sh")], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ControlPlaneError(f"building the control-plane binaries failed:\n{result.stderr[-4000:]}")
    return Path(result.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_kubeconfig(*, path: Path, server: str, ca: Path, client: CertPair, user: str) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "testbed", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": {"client-certificate": str(client.cert), "client-key": str(client.key)}}],
        "contexts": [{"name": "testbed", "context": {"cluster": "testbed", "user": user}}],
        "current-context": "testbed",
    }
    path.write_text(yaml.safe_dump(config))
    return path


@dataclass
class ControlPlane:
    """Start with `start()` or a `with` block; `kubeconfig` is the admin's."""

    work_dir: Path | None = None
    ready_timeout: float = 120.0
    # kwok reports every pod ready the moment it runs. With this set, Strata's pods start unready and only their
    # readiness probes, run by the pod runner, make them ready, as a kubelet would (the demo and end-to-end test).
    probe_readiness: bool = False
    bin_dir: Path = field(init=False)
    kubeconfig: Path = field(init=False)
    operator_kubeconfig: Path = field(init=False)  # the operator's own identity: its requests are audited
    audit_log: Path = field(init=False)
    server: str = field(init=False)
    pki: ClusterPKI = field(init=False)
    _processes: list[ManagedProcess] = field(default_factory=list, init=False)
    _owns_work_dir: bool = field(default=False, init=False)

    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def kubectl(self) -> Path:
        return self.bin_dir / "kubectl"

    @property
    def helm(self) -> Path:
        return self.bin_dir / "helm"

    def start(self) -> None:
        self.bin_dir = binaries_dir()
        if self.work_dir is None:
            self.work_dir = Path(tempfile.mkdtemp(prefix="strata-testbed-"))
            self._owns_work_dir = True
        self.work_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._start_all(self.work_dir)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        while self._processes:
            self._processes.pop().stop()
        if self._owns_work_dir and self.work_dir is not None:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def process(self, name: str) -> ManagedProcess:
        """A component by name (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok)."""
        for process in self._processes:
            if process.name == name:
                return process
        raise KeyError(f"the control plane runs no process named {name!r}")

    def running(self) -> list[str]:
        return [p.name for p in self._processes if p.running()]

    def _spawn(self, name: str, argv: list[str], logs: Path) -> ManagedProcess:
        process = ManagedProcess(name=name, argv=argv, log_dir=logs)
        self._processes.append(process)
        return process

    def _start_all(self, work: Path) -> None:
        logs = work / "logs"
        logs.mkdir(exist_ok=True)
        pki = self.pki = create_pki(work / "pki")
        b = self.bin_dir

        etcd_port, etcd_peer = free_port(), free_port()
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        etcd = self._spawn(
            "etcd",
            [
                str(b / "etcd"),
                "--name=testbed",
                f"--data-dir={work / 'etcd'}",
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
                f"--initial-cluster=testbed=http://127.0.0.1:{etcd_peer}",
                # A throwaway store: skipping fsync keeps a 2-core machine responsive under test load.
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
            logs,
        )
        self._wait(etcd, lambda: _http_ok(f"{etcd_url}/health"))

        api_port = free_port()
        self.audit_log = work / "audit.log"
        self.server = f"https://127.0.0.1:{api_port}"
        apiserver = self._spawn(
            "kube-apiserver",
            [
                str(b / "kube-apiserver"),
                f"--etcd-servers={etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={api_port}",
                f"--tls-cert-file={pki.apiserver.cert}",
                f"--tls-private-key-file={pki.apiserver.key}",
                f"--client-ca-file={pki.ca.cert}",
                f"--service-account-key-file={pki.service_account_pub}",
                f"--service-account-signing-key-file={pki.service_account_key}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=Node,RBAC",
                "--allow-privileged=true",
                f"--cert-dir={work / 'apiserver-certs'}",
                "--profiling=false",
                f"--audit-policy-file={_audit_policy(work)}",
                f"--audit-log-path={self.audit_log}",
                "--audit-log-format=json",
                "--audit-log-mode=blocking",
                "--v=1",
            ],
            logs,
        )
        self.kubeconfig = write_kubeconfig(
            path=work / "admin.kubeconfig", server=self.server, ca=pki.ca.cert, client=pki.admin, user="admin"
        )
        self.operator_kubeconfig = write_kubeconfig(
            path=work / "operator.kubeconfig",
            server=self.server,
            ca=pki.ca.cert,
            client=pki.operator,
            user=OPERATOR_USER,
        )
        admin_tls = _client_tls(pki.ca.cert, pki.admin)
        self._wait(apiserver, lambda: _http_ok(f"{self.server}/readyz", tls=admin_tls))

        kcm_kubeconfig = write_kubeconfig(
            path=work / "controller-manager.kubeconfig",
            server=self.server,
            ca=pki.ca.cert,
            client=pki.controller_manager,
            user="system:kube-controller-manager",
        )
        kcm_port = free_port()
        kcm = self._spawn(
            "kube-controller-manager",
            [
                str(b / "kube-controller-manager"),
                f"--kubeconfig={kcm_kubeconfig}",
                f"--authentication-kubeconfig={kcm_kubeconfig}",
                f"--authorization-kubeconfig={kcm_kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={kcm_port}",
                f"--cert-dir={work / 'kcm-certs'}",
                "--leader-elect=false",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={pki.service_account_key}",
                f"--root-ca-file={pki.ca.cert}",
                f"--cluster-signing-cert-file={pki.ca.cert}",
                f"--cluster-signing-key-file={pki.ca.key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--v=1",
            ],
            logs,
        )
        scheduler_kubeconfig = write_kubeconfig(
            path=work / "scheduler.kubeconfig",
            server=self.server,
            ca=pki.ca.cert,
            client=pki.scheduler,
            user="system:kube-scheduler",
        )
        scheduler_port = free_port()
        scheduler = self._spawn(
            "kube-scheduler",
            [
                str(b / "kube-scheduler"),
                f"--kubeconfig={scheduler_kubeconfig}",
                f"--authentication-kubeconfig={scheduler_kubeconfig}",
                f"--authorization-kubeconfig={scheduler_kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={scheduler_port}",
                "--leader-elect=false",
                "--v=1",
            ],
            logs,
        )
        kwok_port = free_port()
        kwok = self._spawn(
            "kwok",
            [
                str(b / "kwok"),
                f"--kubeconfig={self.kubeconfig}",
                f"--config={self._kwok_stages(work)}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_MANAGED_ANNOTATION}=fake",
                "--node-lease-duration-seconds=40",
                # Pod IPs on 127.0.0.0/8 are local addresses here: the pod runner's processes serve on them. Each
                # control plane takes its own /16, so two on one machine (a test session and the demo it runs)
                # never hand out the same pod IP and never reach each other's pods.
                f"--cidr=127.{secrets.choice(range(16, 255))}.0.0/16",
                "--node-ip=10.1.0.1",
                f"--server-address=127.0.0.1:{kwok_port}",
            ],
            logs,
        )
        insecure = _insecure_tls()
        self._wait(kcm, lambda: _http_ok(f"https://127.0.0.1:{kcm_port}/healthz", tls=insecure))
        self._wait(scheduler, lambda: _http_ok(f"https://127.0.0.1:{scheduler_port}/healthz", tls=insecure))
        self._wait(kwok, lambda: _http_ok(f"http://127.0.0.1:{kwok_port}/healthz"))

    def _kwok_stages(self, work: Path) -> Path:
        """kwok's lifecycle stages; with probe_readiness, its pod-ready stage skips Strata's pods and a copy of it
        brings them up Running with an IP but not ready."""
        pinned = self.bin_dir / "kwok-stages.yaml"
        if not self.probe_readiness:
            return pinned
        stages = [doc for doc in yaml.safe_load_all(pinned.read_text()) if doc]
        ready = next(doc for doc in stages if doc["metadata"]["name"] == "pod-ready")
        unready = copy.deepcopy(ready)
        strata = {"key": '.metadata.labels."app.kubernetes.io/name"', "values": ["strata"]}
        ready["spec"]["selector"]["matchExpressions"].append(strata | {"operator": "NotIn"})
        unready["metadata"]["name"] = "strata-pod-running-unready"
        unready["spec"]["selector"]["matchExpressions"].append(strata | {"operator": "In"})
        template = unready["spec"]["next"]["statusTemplate"]
        for before, after in _UNREADY:
            if before not in template:
                raise ControlPlaneError(f"kwok's pod-ready template changed: {before!r} not found")
            template = template.replace(before, after)
        unready["spec"]["next"]["statusTemplate"] = template
        path = work / "kwok-stages.yaml"
        path.write_text(yaml.safe_dump_all([*stages, unready]))
        return path

    def _wait(self, process: ManagedProcess, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if not process.running():
                raise ControlPlaneError(f"{process.name} exited during start-up:\n{process.log_tail()}")
            if ready():
                return
            time.sleep(0.2)
        raise ControlPlaneError(
            f"{process.name} was not ready within {self.ready_timeout:.0f} s:\n{process.log_tail()}"
        )


def _audit_policy(work: Path) -> Path:
    """Only the operator's requests are logged (their verb, resource and scope), one line each when answered; a
    watch is logged when its response starts, so one still open is counted too."""
    policy = {
        "apiVersion": "audit.k8s.io/v1",
        "kind": "Policy",
        "omitStages": ["RequestReceived"],
        "rules": [{"level": "Metadata", "users": [OPERATOR_USER]}, {"level": "None"}],
    }
    path = work / "audit-policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    return path


def _client_tls(ca: Path, client: CertPair) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca))
    context.load_cert_chain(str(client.cert), str(client.key))
    return context


def _insecure_tls() -> ssl.SSLContext:
    # Controller manager and scheduler serve health on self-signed certificates they make at start.
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def _http_ok(url: str, *, tls: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=tls) as response:  # noqa: S310 - loopback URLs we built
            return bool(response.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError, ssl.SSLError):
        return False
