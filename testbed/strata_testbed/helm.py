"""The pinned helm binary of the test bed, driven with typed calls: render, lint, install, uninstall.

Values go to helm as a file, exactly as a platform team passes them with `-f`; nothing is set with `--set` string
parsing, so a test states its values as the YAML a person would write.
"""

from __future__ import annotations

import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from strata_testbed.controlplane import TESTBED_DIR, binaries_dir

CHART_DIR = TESTBED_DIR.parent / "charts" / "strata"
# Offline rendering (template, lint) has no API server to ask: render for the test bed's Kubernetes. helm built
# with `go install` would otherwise assume v1.20, below the chart's kubeVersion.
KUBE_VERSION = "v1.36.3"
Manifest = dict[str, Any]


class HelmFailed(RuntimeError):
    """helm exited non-zero; the message is its stderr."""


@dataclass(frozen=True)
class Helm:
    binary: Path
    kubeconfig: Path | None = None

    @classmethod
    def pinned(cls, *, kubeconfig: Path | None = None) -> Helm:
        return cls(binary=binaries_dir() / "helm", kubeconfig=kubeconfig)

    def run(self, *args: str, values: Manifest | None = None) -> str:
        with tempfile.TemporaryDirectory(prefix="strata-helm-") as scratch:
            argv = [str(self.binary), *args]
            if values is not None:
                path = Path(scratch) / "values.yaml"
                path.write_text(yaml.safe_dump(values))
                argv += ["--values", str(path)]
            if self.kubeconfig is not None:
                argv += ["--kubeconfig", str(self.kubeconfig)]
            # helm keeps caches and repository settings under these; a scratch folder keeps runs independent.
            env = {
                # The Kubernetes client under helm caches discovery in $HOME/.kube: keep that in the scratch folder too.
                "HOME": scratch,
                "HELM_CACHE_HOME": f"{scratch}/cache",
                "HELM_CONFIG_HOME": f"{scratch}/config",
                "HELM_DATA_HOME": f"{scratch}/data",
                "PATH": "/usr/bin:/bin",
            }
            result = subprocess.run(argv, capture_output=True, text=True, env=env, check=False, timeout=120)
        if result.returncode != 0:
            raise HelmFailed(result.stderr.strip() or result.stdout.strip())
        return result.stdout

    def template(self, values: Manifest | None = None, *, release: str = "strata", namespace: str = "strata") -> str:
        args = ["template", release, str(CHART_DIR), "--namespace", namespace, "--kube-version", KUBE_VERSION]
        return self.run(*args, values=values or {})

    def manifests(
        self, values: Manifest | None = None, *, release: str = "strata", namespace: str = "strata"
    ) -> list[Manifest]:
        rendered = self.template(values, release=release, namespace=namespace)
        return [doc for doc in yaml.safe_load_all(rendered) if doc]

    def lint(self, values: Manifest | None = None) -> str:
        return self.run("lint", "--strict", "--kube-version", KUBE_VERSION, str(CHART_DIR), values=values or {})

    def install(self, *, release: str, namespace: str, values: Manifest | None = None) -> str:
        return self.run(
            "install", release, str(CHART_DIR), "--namespace", namespace, "--wait=false", values=values or {}
        )

    def uninstall(self, *, release: str, namespace: str) -> str:
        return self.run("uninstall", release, "--namespace", namespace)


def find(manifests: list[Manifest], kind: str, name: str | None = None) -> list[Manifest]:
    """The rendered objects of `kind` (and `name`, when given)."""
    return [m for m in manifests if m["kind"] == kind and (name is None or m["metadata"]["name"] == name)]
