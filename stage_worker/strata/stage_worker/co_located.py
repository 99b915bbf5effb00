"""Several consecutive stages in one stage-worker process: the stages that share a device.

Two stage processes on one GPU take turns on it, each with a CUDA context of its own, and no hop between processes is
free; in one process the next stage takes the tensor itself (strata.stage_worker.in_process). Each stage is still a
StageService of its own, on a port of its own, so a coordinator, the fencing and the load status see the same stages
as when each runs alone. The process is configured as one stage would be, over the whole span of its stages, and
`split_at` names the layers where one stage ends and the next begins; the stages take consecutive indices from the
process's. The first stage's listen address, or each stage's, comes from `listen` (one address per stage,
comma-separated, or one address with port 0 for all). Only the process's last stage has a next stage elsewhere.

The stages load one after the other on one thread, the last first: on a GPU, a CUDA graph captured while another
thread of the process allocates, copies or launches work is invalidated, and compiling two decode steps at once
gains nothing on one device. Last first, the first stage (the only one a coordinator sends steps to) says it has
loaded only once the stages after it have, so no step runs here while a later stage captures its decode step. A
stage that fails to load reports it in its own load status, and the stages before it load still, so each says what
it can.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from itertools import pairwise

from strata.stage_worker.server import RunningStage
from strata.stage_worker.settings import StageSettings


def parse_split(text: str) -> tuple[int, ...]:
    """'2,4' -> (2, 4); '' -> (): the layers where a process's stages divide."""
    try:
        return tuple(int(part) for part in text.split(",")) if text.strip() else ()
    except ValueError:
        raise ValueError(f"split-at {text!r} is not a comma-separated list of layer numbers") from None


def co_located_settings(process: StageSettings, *, split_at: tuple[int, ...]) -> list[StageSettings]:
    """One StageSettings per stage of the process: its span divided at `split_at`, each stage's listen address, and
    the process's next stage on the last one. Raises ValueError naming what does not fit."""
    bounds = (process.layer_start, *split_at, process.layer_end)
    if any(start >= end for start, end in pairwise(bounds)):
        raise ValueError(
            f"split-at {','.join(map(str, split_at))} must divide layers [{process.layer_start}, "
            f"{process.layer_end}) at increasing layers inside it"
        )
    count = len(bounds) - 1
    addresses = process.listen.split(",")
    if len(addresses) == 1 and count > 1:
        if not addresses[0].endswith(":0"):
            raise ValueError(
                f"listen address {addresses[0]} serves one stage; {count} stages in one process need one address "
                "each (comma-separated), or port 0"
            )
        addresses *= count
    if len(addresses) != count:
        raise ValueError(f"listen names {len(addresses)} addresses for {count} stages; give one per stage")
    return [
        dataclasses.replace(
            process,
            stage_index=process.stage_index + k,
            layer_start=start,
            layer_end=end,
            listen=addresses[k],
            next_stage=process.next_stage if k == count - 1 else "",
        )
        for k, (start, end) in enumerate(pairwise(bounds))
    ]


class CoLocatedStages:
    """The stages of one process, started (each listening), loading one by one on one thread; first to last."""

    def __init__(self, settings: Sequence[StageSettings], *, max_workers: int = 16) -> None:
        self.loader = threading.Thread(target=self._load_all, daemon=True, name="stage-loader")
        self.stages: list[RunningStage] = []
        then = None
        try:
            for k in reversed(range(len(settings))):
                stage = RunningStage(
                    settings[k], max_workers=max_workers, then=then, after_in_process=k > 0, loader=self.loader
                )
                self.stages.insert(0, stage)
                then = stage.service
        except BaseException:
            self.stop(grace_s=0)
            raise
        self.loader.start()

    def _load_all(self) -> None:
        for stage in reversed(self.stages):
            stage.service.load()  # records its own failure; the stage before it loads still

    def stop(self, grace_s: float | None = None) -> None:
        for stage in self.stages:
            stage.stop(grace_s)
