"""`strata serve` as a test sees it: a real process tree on loopback, ready when it says so, stopped with Ctrl-C.

A serve that does not exit on Ctrl-C within the stop timeout is a failure, not something to clean up quietly: its
process group is killed so the run goes on, and the context raises ServeDidNotStop.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from strata_testbed.processes import OutputLines

PROC = Path("/proc")


class ServeDidNotStop(RuntimeError):
    """`strata serve` was still running when the stop timeout after SIGINT ran out."""


@dataclass(frozen=True)
class Served:
    base_url: str  # http://127.0.0.1:PORT/v1
    model: str
    process: subprocess.Popen[bytes]
    output: OutputLines  # what it printed, stdout and stderr, as it comes

    @property
    def root(self) -> str:
        return self.base_url.removesuffix("/v1")

    def metric(self, name: str, *, timeout_s: float = 30.0) -> float:
        """The value of one sample of the gateway's /metrics: its name, with its labels when it has any."""
        text = httpx.get(f"{self.root}/metrics", timeout=timeout_s).text
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        if match is None:
            raise LookupError(f"{name} is not in /metrics:\n{text}")
        return float(match.group(1))


@contextlib.contextmanager
def strata_serve(*args: str, timeout_s: float = 90.0, stop_timeout_s: float = 20.0) -> Iterator[Served]:
    """Run `strata serve ARGS --port 0` until it prints "ready"; SIGINT it afterwards, as a person would."""
    process = subprocess.Popen(
        [sys.executable, "-m", "strata.cli", "serve", *args, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    assert process.stdout is not None
    output = OutputLines(process.stdout)
    try:
        if output.wait_for(lambda line: line.strip() == "ready", timeout=timeout_s) is None:
            raise RuntimeError("strata serve did not become ready:\n" + output.text())
        endpoint = output.wait_for(lambda line: line.startswith("endpoint "), timeout=0) or ""
        serving = output.wait_for(lambda line: line.startswith("serving "), timeout=0) or ""
        base_url, model = endpoint.split()[1], serving.split("'")[1]
        yield Served(base_url=base_url, model=model, process=process, output=output)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=stop_timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise ServeDidNotStop(f"strata serve was still running {stop_timeout_s:.0f} s after SIGINT") from None
        finally:
            process.stdout.close()


def process_tree(pid: int) -> dict[int, int]:
    """`pid` and every descendant now running, each with its process group (from /proc: the test bed is Linux)."""
    parents: dict[int, int] = {}
    groups: dict[int, int] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            # Fields after the command name, which is in parentheses and may hold spaces: state, ppid, pgrp, ...
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
            if fields[0] != "Z":
                parents[int(entry.name)], groups[int(entry.name)] = int(fields[1]), int(fields[2])
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, ppid in parents.items() if ppid == parent and child not in tree]
        tree.update(children)
        frontier += children
    return {member: groups[member] for member in tree if member in groups}


def living(*, pids: set[int], groups: set[int]) -> set[int]:
    """Those of `pids`, and any process in one of `groups`, that still run (zombies count as gone)."""
    found = set()
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
            if fields[0] != "Z" and (int(entry.name) in pids or int(fields[2]) in groups):
                found.add(int(entry.name))
    return found


def stage_pid(serve_pid: int, index: int) -> int | None:
    """The process that runs stage `index` under `strata serve` (its STRATA_STAGE_INDEX, and with STRATA_SPLIT_AT the
    stages after it in the same process), None while there is none."""
    for pid in process_tree(serve_pid):
        if pid == serve_pid:
            continue
        with contextlib.suppress(OSError):
            pairs = (entry.partition(b"=") for entry in (PROC / str(pid) / "environ").read_bytes().split(b"\0"))
            env = {key: value for key, _, value in pairs}
            if b"STRATA_STAGE_INDEX" not in env:
                continue
            first = int(env[b"STRATA_STAGE_INDEX"])
            split = env.get(b"STRATA_SPLIT_AT", b"").strip()
            if first <= index <= first + (split.count(b",") + 1 if split else 0):
                return pid
    return None
