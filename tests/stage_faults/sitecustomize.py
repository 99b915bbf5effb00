"""Faults a test injects into `strata stage-worker` processes: those `strata serve` starts, and the test bed's stage
pods (tests/operator/test_operator_cluster.py passes the variables to the pod runner).

The test puts this folder on PYTHONPATH and names a fault in STRATA_TEST_FAULT. Python imports this module at start-up
in every process; it changes stage workers only, at the one point the fault names, so a real stage fails the way a
GPU would make it fail. The product's code knows nothing of it. With STRATA_TEST_FAULT_AFTER_FIRST naming a file that
does not exist yet, the first stage worker creates it and runs whole; the fault hits the ones started after it (a
stage that `strata serve` starts again).
"""

from __future__ import annotations

import os
import signal
import sys
import time


def _inject(fault: str) -> None:
    import torch
    from strata.stage_worker import stage_load
    from strata.stage_worker.engine import Engine

    def out_of_memory(**_: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    def capture_fails(self: Engine) -> None:
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing (injected)")

    def killed(**_: object) -> None:
        # The loader starts before the worker prints its port: a moment's wait makes this a death mid-load, after
        # serve knows the stage, rather than a worker that never started.
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    if fault == "kv-pool-out-of-memory":
        setattr(stage_load, "KVPool", out_of_memory)  # noqa: B010  # a module attribute mypy would not let us assign
    elif fault == "decode-step-fails":
        setattr(Engine, "warm_up", capture_fails)  # noqa: B010
    elif fault == "killed-while-loading":
        setattr(stage_load, "load_stage", killed)  # noqa: B010
    else:
        raise SystemExit(f"sitecustomize: unknown STRATA_TEST_FAULT {fault!r}")


def _first_worker(marker: str) -> bool:
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))  # atomic: exactly one worker creates it
    except FileExistsError:
        return False
    return True


# At start-up sys.argv holds the arguments after `-m MODULE` (the module's name comes later).
if "stage-worker" in sys.argv and (_fault := os.environ.get("STRATA_TEST_FAULT")):
    _marker = os.environ.get("STRATA_TEST_FAULT_AFTER_FIRST")
    if not (_marker and _first_worker(_marker)):
        _inject(_fault)
