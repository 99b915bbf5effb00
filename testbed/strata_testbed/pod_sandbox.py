"""What a kubelet puts around a container, for pods the test bed runs as local processes.

A pod sees the cluster through two files the kubelet manages: `/etc/hosts`, and the ServiceAccount token under
`/var/run/secrets/kubernetes.io/serviceaccount`. Each pod process gets its own mount namespace in which both are
bind-mounted from files this module keeps up to date, so the process resolves the cluster DNS names the operator
wrote (`<pod>.<headless service>.<namespace>.svc.cluster.local`) and logs in with its own ServiceAccount through
the client library's ordinary in-cluster path. Nothing on the host changes but one empty mount-point folder.
"""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass
from pathlib import Path

from kubernetes import client

from strata_testbed.processes import ManagedProcess

CLUSTER_DOMAIN = "cluster.local"
NEVER = dt.datetime.min.replace(tzinfo=dt.UTC)
TOKEN_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TOKEN_SECONDS = 3600
# The kubelet renews a projected token once 80% of its life is gone; the client library re-reads the file.
RENEW_AFTER = dt.timedelta(seconds=TOKEN_SECONDS * 0.8)
_BASE_HOSTS = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
# $1: the hosts file, $2: the token folder or "", then the container's argv.
_ENTER = (
    'set -e; mount --bind "$1" /etc/hosts; '
    'if [ -n "$2" ]; then mount --bind "$2" ' + str(TOKEN_DIR) + "; fi; "
    'shift 2; exec "$@"'
)


class SandboxUnavailable(RuntimeError):
    """This machine cannot give a process its own mount namespace (the runner needs root for that)."""


def check_sandbox() -> None:
    if os.geteuid() != 0:
        raise SandboxUnavailable(
            "the pod runner bind-mounts each pod's /etc/hosts and ServiceAccount token in a private mount "
            "namespace, which needs root"
        )


def pod_dns_names(pod: client.V1Pod) -> list[str]:
    """The names cluster DNS gives a pod: `<hostname>.<subdomain>.<namespace>.svc.cluster.local` and shorter."""
    spec, namespace = pod.spec, pod.metadata.namespace
    if not spec.hostname or not spec.subdomain:
        return []
    host = f"{spec.hostname}.{spec.subdomain}"
    return [f"{host}.{namespace}.svc.{CLUSTER_DOMAIN}", f"{host}.{namespace}.svc", f"{host}.{namespace}"]


class HostsFile:
    """One hosts file for every pod the runner starts; rewritten in place so the bind mounts keep seeing it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._entries: dict[str, list[str]] = {}
        self.path.write_text(_BASE_HOSTS)

    def update(self, entries: dict[str, list[str]]) -> None:
        """`entries`: pod IP -> its names. Written only when something changed."""
        if entries == self._entries:
            return
        self._entries = dict(entries)
        lines = [f"{ip}\t{' '.join(names)}\n" for ip, names in sorted(entries.items()) if names]
        # Rewritten in place, not renamed over: a bind mount follows the inode it was made from.
        with self.path.open("r+") as file:
            file.write(_BASE_HOSTS + "".join(lines))
            file.truncate()


@dataclass
class ServiceAccountFiles:
    """The token folder of one pod: token, ca.crt and namespace, renewed before the token expires."""

    folder: Path
    namespace: str
    account: str
    pod: str
    pod_uid: str
    issued: dt.datetime = NEVER

    def refresh(self, core: client.CoreV1Api, *, ca: Path) -> None:
        now = dt.datetime.now(dt.UTC)
        if now - self.issued < RENEW_AFTER:
            return
        request = core.create_namespaced_service_account_token(
            name=self.account,
            namespace=self.namespace,
            body={
                "spec": {
                    "expirationSeconds": TOKEN_SECONDS,
                    "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": self.pod, "uid": self.pod_uid},
                }
            },
        )
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "ca.crt").write_bytes(ca.read_bytes())
        (self.folder / "namespace").write_text(self.namespace)
        # Renamed into place: the folder is what is mounted, so a reader sees the old token or the new one.
        scratch = self.folder / ".token.new"
        scratch.write_text(request.status.token)
        scratch.replace(self.folder / "token")
        self.issued = now


def mounts_token(pod: client.V1Pod, core: client.CoreV1Api) -> bool:
    """The kubelet's rule: the pod's automountServiceAccountToken, else its ServiceAccount's, else true."""
    if pod.spec.automount_service_account_token is not None:
        return bool(pod.spec.automount_service_account_token)
    account = core.read_namespaced_service_account(
        name=pod.spec.service_account_name or "default", namespace=pod.metadata.namespace
    )
    return account.automount_service_account_token is not False


def start_in_sandbox(
    *, name: str, argv: list[str], env: dict[str, str], hosts: HostsFile, token: Path | None, log_dir: Path
) -> ManagedProcess:
    """Start `argv` in a private mount namespace with the pod's hosts file and (when it has one) token folder."""
    if token is not None:
        TOKEN_DIR.mkdir(parents=True, exist_ok=True)
    wrapper = ["unshare", "--mount", "--propagation", "private", "sh", "-c", _ENTER, "pod-sandbox"]
    return ManagedProcess(
        name=name,
        argv=[*wrapper, str(hosts.path), str(token or ""), *argv],
        log_dir=log_dir,
        env=env,
        inherit_env=False,
    )
