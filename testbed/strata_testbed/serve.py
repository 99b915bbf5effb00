"""`strata serve` as a test sees it: a real process tree on loopback, ready when it says so, stopped with Ctrl-C."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Served:
    base_url: str  # http://127.0.0.1:PORT/v1
    model: str
    process: subprocess.Popen[bytes]

    @property
    def root(self) -> str:
        return self.base_url.removesuffix("/v1")


@contextlib.contextmanager
def strata_serve(*args: str, timeout_s: float = 90.0) -> Iterator[Served]:
    """Run `strata serve ARGS --port 0` until it prints "ready"; SIGINT it afterwards, as a person would."""
    process = subprocess.Popen(
        [sys.executable, "-m", "strata.cli", "serve", *args, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    assert process.stdout is not None
    lines: list[str] = []
    base_url = model = ""
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and process.poll() is None:
            if not select.select([process.stdout], [], [], 0.2)[0]:
                continue
            line = process.stdout.readline().decode()
            lines.append(line)
            if line.startswith("endpoint "):
                base_url = line.split()[1]
            if line.startswith("serving "):
                model = line.split("'")[1]
            if line.strip() == "ready":
                break
        else:
            raise RuntimeError("strata serve did not become ready:\n" + "".join(lines))
        yield Served(base_url=base_url, model=model, process=process)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        process.stdout.close()
