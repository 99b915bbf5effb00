"""`strata operator` as its own process against the test bed, exactly as it runs in a cluster."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path


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
