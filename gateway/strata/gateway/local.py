"""Single-machine pipelines for `strata serve`: an even layer split, and stage workers as child processes.

The planner (strata.operator.planner) places stages on a cluster's GPUs; on one machine there is one device kind and
nothing to search, so the layers are split evenly into contiguous spans, earlier stages taking the remainder.
Children get PR_SET_PDEATHSIG and their own process group: they die with `strata serve` even when it is killed
with SIGKILL, and stopping one stops whatever it started.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

_PR_SET_PDEATHSIG = 1

# Stages that share one machine's cores must not spin: OpenMP's default keeps an idle stage's threads busy-waiting
# after each step, stealing the cores the stage doing the work needs (on 2 cores this cut two stages to a quarter
# of one stage's speed). Passive waiting costs a stage in its own pod nothing. The caller's environment still wins.
CO_LOCATED_STAGE_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def even_spans(layers: int, stages: int) -> list[tuple[int, int]]:
    """`stages` contiguous [start, end) spans covering `layers` layers; sizes differ by at most one."""
    if not 1 <= stages <= layers:
        raise ValueError(f"cannot split {layers} layers into {stages} stages")
    base, extra = divmod(layers, stages)
    spans, start = [], 0
    for index in range(stages):
        end = start + base + (1 if index < extra else 0)
        spans.append((start, end))
        start = end
    return spans


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class StageStartError(RuntimeError):
    """The stage worker exited, or printed no port in time, before it listened; carries the end of its log."""

    def __init__(self, reason: str, *, log_path: Path, log_tail: str) -> None:
        super().__init__(f"the stage worker did not start ({reason}); its log is {log_path}:\n{log_tail}")
        self.reason = reason
        self.log_tail = log_tail


class StageProcess:
    """`strata stage-worker` as a child, configured through STRATA_* as the operator configures a stage pod.

    `cancel`, when set while the worker starts, cuts the start short (the supervisor stopping mid-restart, or
    `strata serve` stopping because a stage it started before this one failed to load).
    """

    def __init__(
        self,
        *,
        env: Mapping[str, str],
        log_path: Path,
        start_timeout_s: float = 60.0,
        cancel: threading.Event | None = None,
    ) -> None:
        self.log_path = log_path
        self._log = log_path.open("ab")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "strata.cli", "stage-worker"],
            stdout=subprocess.PIPE,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            env={**CO_LOCATED_STAGE_ENV, **os.environ, **env},
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        self.port = self._read_port(start_timeout_s, cancel or threading.Event())

    def _read_port(self, timeout_s: float, cancel: threading.Event) -> int:
        """The port the worker prints once its server listens ("stage N listening on port P")."""
        assert self._proc.stdout is not None, "stdout is a pipe"
        deadline = time.monotonic() + timeout_s
        line = b""
        while time.monotonic() < deadline and self._proc.poll() is None and not cancel.is_set():
            readable, _, _ = select.select([self._proc.stdout], [], [], 0.2)
            if readable:
                line = self._proc.stdout.readline()
                if b"listening on port" in line:
                    return int(line.split()[-1])
        if cancel.is_set():
            reason = "cancelled"
        elif self._proc.poll() is not None:
            reason = f"it exited with status {self._proc.returncode}"
        else:
            reason = f"no port within {timeout_s:g} s"
        self.stop()
        raise StageStartError(reason, log_path=self.log_path, log_tail=self.log_tail())

    def running(self) -> bool:
        return self._proc.poll() is None

    @property
    def exit_code(self) -> int | None:
        """None while it runs; its status once it has exited (negative: the signal that killed it)."""
        return self._proc.poll()

    def send_signal(self, signum: int) -> None:
        """Signal the stage's process group (SIGSTOP freezes it, SIGKILL kills it as a lost node would)."""
        os.killpg(self._proc.pid, signum)

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self, *, grace_s: float = 5.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after `grace_s`."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._log.close()
