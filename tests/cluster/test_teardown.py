"""The test bed leaves nothing running: not after a clean stop, not after Ctrl-C, not after SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.cluster

# Starts a control plane, prints the pids of its processes, then waits to be stopped.
_SCRIPT = """
import sys, time
from strata_testbed.controlplane import ControlPlane
with ControlPlane() as plane:
    print(" ".join(str(p.pid) for p in plane._processes), flush=True)
    time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize(
    "stop_signal",
    [
        pytest.param(signal.SIGINT, id="Ctrl-C stops every component"),
        pytest.param(signal.SIGKILL, id="a killed test run still takes every component with it"),
    ],
)
def test_no_component_outlives_the_process_that_started_it(stop_signal: signal.Signals) -> None:
    runner = subprocess.Popen([sys.executable, "-c", _SCRIPT], stdout=subprocess.PIPE, text=True)
    assert runner.stdout is not None
    pids = [int(p) for p in runner.stdout.readline().split()]
    assert len(pids) == 5, "etcd, apiserver, controller manager, scheduler and kwok"
    assert all(_alive(pid) for pid in pids)

    runner.send_signal(stop_signal)
    runner.wait(timeout=60)
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in pids if _alive(pid)] == []
