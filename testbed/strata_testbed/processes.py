"""Child processes that cannot outlive the process that started them.

Every child gets PR_SET_PDEATHSIG, so even a test run killed with SIGKILL leaves no process behind, and its own
process group, so stopping it stops whatever it started in turn.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:
    # SIGKILL, not SIGTERM: an orphaned kube-apiserver would spend its graceful shutdown waiting for an etcd
    # that died beside it, and nothing of a throwaway test bed needs to be flushed.
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class ManagedProcess:
    """One long-running child with its output in a log file."""

    def __init__(
        self,
        *,
        name: str,
        argv: Sequence[str],
        log_dir: Path,
        env: Mapping[str, str] | None = None,
        inherit_env: bool = True,
    ) -> None:
        """`env` adds to this process's environment, or with `inherit_env=False` is the whole of it."""
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("ab")
        self._proc = subprocess.Popen(
            list(argv),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**(os.environ if inherit_env else {}), **(env or {})},
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )

    @property
    def pid(self) -> int:
        return self._proc.pid

    def running(self) -> bool:
        return self._proc.poll() is None

    def pause(self) -> None:
        """SIGSTOP: the process keeps its sockets but does nothing, like a partitioned or frozen component."""
        os.killpg(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self._proc.pid, signal.SIGCONT)

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self, *, grace: float = 5.0) -> None:
        """SIGTERM the process group, then SIGKILL what is left after `grace` seconds."""
        if self.running():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while self.running() and time.monotonic() < deadline:
                time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=grace)
        self._log.close()


class OutputLines:
    """Every line a child writes to a pipe, read by a thread as it comes.

    select() on the pipe and readline() on Python's buffered reader do not mix: one read can pull several lines into
    the buffer, after which the pipe is empty and select() waits for output that was already read. A thread that
    only reads never misses a line.
    """

    def __init__(self, stream: IO[bytes]) -> None:
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._read, args=(stream,), name="output-lines", daemon=True)
        self._thread.start()

    def _read(self, stream: IO[bytes]) -> None:
        for raw in stream:
            with self._changed:
                self.lines.append(raw.decode(errors="replace"))
                self._changed.notify_all()
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def wait_for(self, predicate: Callable[[str], bool], *, timeout: float) -> str | None:
        """The first line (already read or still to come) that satisfies `predicate`; None at the end of the
        output or after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._changed:
            while True:
                for line in self.lines[seen:]:
                    if predicate(line):
                        return line
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if self._closed or left <= 0:
                    return None
                self._changed.wait(left)

    def text(self) -> str:
        with self._changed:
            return "".join(self.lines)
