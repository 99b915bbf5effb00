"""Making a stage's decode step run before the stage says it is ready: the fastest path that works, or a failure.

On GPUs the decode step is compiled (torch.compile) and captured in CUDA graphs; either can fail (a compiler error,
a capture invalidated by work on another stream, memory running out while capturing). A slower path is taken only
once it has been shown to work: each path's engine runs the warm-up steps (strata.stage_worker.engine's `warm_up`:
compiling, capturing and replaying every batch shape it covers), and a path whose warm-up raises is logged and
passed over. When no path works, DecodeStepError carries every path's error, and the stage reports that as its load
failure. On the CPU there is one path, eager, and it is warmed up the same way, so no stage reports ready with a
decode step that has never run.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from strata.stage_worker.engine import Engine
from strata.stage_worker.errors import StageError
from strata.stage_worker.kv_pool import KVPool
from strata.stage_worker.model import StageModel

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class DecodePath:
    """One way to run the decode step; `paths_for` lists them fastest first."""

    name: str
    cuda_graphs: bool
    compiled: bool


COMPILED_GRAPHS = DecodePath(name="compiled blocks in CUDA graphs", cuda_graphs=True, compiled=True)
GRAPHS = DecodePath(name="CUDA graphs alone", cuda_graphs=True, compiled=False)
EAGER = DecodePath(name="eager", cuda_graphs=False, compiled=False)


class DecodeStepError(StageError):
    """No path could run the decode step; the message names each path tried and why it failed."""


def paths_for(device: torch.device, *, experts: bool = False) -> tuple[DecodePath, ...]:
    """The paths a stage on `device` tries, fastest first. A CUDA graph failure does not fall back to eager: a
    stage that cannot capture on its own device is broken in a way that serving slowly would only hide. A mixture
    of experts decodes eagerly everywhere (strata.stage_worker.engine says why)."""
    if device.type == "cuda" and not experts:
        return (COMPILED_GRAPHS, GRAPHS)
    return (EAGER,)


def warm_engine(
    *,
    model: StageModel,
    pool: KVPool,
    device: torch.device,
    dtype: torch.dtype,
    stage_index: int,
    paths: tuple[DecodePath, ...] | None = None,
) -> Engine:
    """The engine of the first of `paths` (default: `paths_for` the device and model) whose warm-up runs."""
    failures: list[str] = []
    for path in paths or paths_for(device, experts=bool(model.config.n_expert)):
        started = time.monotonic()
        try:
            engine = Engine(
                model=model, pool=pool, device=device, dtype=dtype, cuda_graphs=path.cuda_graphs, compiled=path.compiled
            )
            engine.warm_up()
        except Exception as exc:  # any failure of this path: the next one is tried, and all of them are reported
            failures.append(f"{path.name}: {type(exc).__name__}: {exc}")
            log.warning("stage %d: the decode step failed on the %s path", stage_index, path.name, exc_info=True)
            continue
        if failures:
            log.warning("stage %d: serving decode steps on the slower %s path", stage_index, path.name)
        log.info("stage %d: decode step ready (%s) in %.1f s", stage_index, path.name, time.monotonic() - started)
        return engine
    raise DecodeStepError("the decode step runs on no path: " + "; ".join(failures))
