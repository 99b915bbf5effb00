"""Single-machine pipelines for `strata serve`: an even layer split, and stage workers as child processes (one stage
each, or several consecutive stages that share a device: STRATA_SPLIT_AT, strata.stage_worker.co_located).

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


def stage_count(env: Mapping[str, str]) -> int:
    """How many stages a stage worker configured by `env` runs: one, and one more per STRATA_SPLIT_AT layer."""
    split = env.get("STRATA_SPLIT_AT", "").strip()
    return 1 + (split.count(",") + 1 if split else 0)


class StageProcess:
    """`strata stage-worker` as a child, configured through STRATA_* as the operator configures a stage pod; with
    STRATA_SPLIT_AT, several stages in one process, each listening on a port of its own (`ports`, first to last).

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
        first = int(env.get("STRATA_STAGE_INDEX", "0"))
        self.stages = tuple(range(first, first + stage_count(env)))
        self.log_path = log_path
        self._log = log_path.open("ab")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "strata.cli", "stage-worker"],
            stdout=subprocess.PIPE,
            bufsize=0,  # unbuffered: a second port line read ahead into a buffer would hide from select()
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            env={**CO_LOCATED_STAGE_ENV, **os.environ, **env},
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        self.ports = self._read_ports(start_timeout_s, cancel or threading.Event())

    @property
    def port(self) -> int:
        """The first stage's port: where the stage before this process, or the gateway, sends."""
        return self.ports[0]

    @property
    def name(self) -> str:
        """How messages call it: 'stage 1', or 'the process of stages 0 and 1'."""
        if len(self.stages) == 1:
            return f"stage {self.stages[0]}"
        return f"the process of stages {', '.join(map(str, self.stages[:-1]))} and {self.stages[-1]}"

    def _read_ports(self, timeout_s: float, cancel: threading.Event) -> tuple[int, ...]:
        """The ports the worker prints once its servers listen ("stage N listening on port P", one line a stage)."""
        assert self._proc.stdout is not None, "stdout is a pipe"
        deadline = time.monotonic() + timeout_s
        ports: list[int] = []
        while time.monotonic() < deadline and self._proc.poll() is None and not cancel.is_set():
            readable, _, _ = select.select([self._proc.stdout], [], [], 0.2)
            if readable:
                line = self._proc.stdout.readline()
                if b"listening on port" in line:
                    ports.append(int(line.split()[-1]))
                    if len(ports) == len(self.stages):
                        return tuple(ports)
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
