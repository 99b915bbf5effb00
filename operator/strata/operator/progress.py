"""Load progress of a deployment's stages, asked of each stage pod over gRPC, and the failures they report.

A stage loads gigabytes before it turns ready; the operator folds each stage's bytes loaded over bytes needed into
the ModelDeployment's status so `kubectl get -o yaml` shows where a slow start stands. A stage whose load failed
says why in the same answer (its process keeps running, unready, so the message can be read): `load_failure` turns
those answers into the one message the StagesReady condition and the LoadFailed Event carry. A stage that does not
answer within the timeout simply has no entry this time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from strata.operator.names import LABEL_STAGE, STAGE_PORT
from strata.operator.status import MAX_CONDITION_MESSAGE_CHARS, LoadProgress
from strata.rpc.v1 import stage_pb2, stage_pb2_grpc

PROBE_TIMEOUT_SECONDS = 1.0
MAX_STAGE_ERROR_CHARS = 2000  # one stage's error in a condition message: a traceback-sized error stays readable


@dataclass(frozen=True, kw_only=True)
class StageLoad:
    stage: int
    bytes_loaded: int
    bytes_total: int
    error: str = ""  # why the stage's load failed; empty while it loads or once it has loaded

    def progress(self) -> LoadProgress:
        return LoadProgress(stage=self.stage, bytesLoaded=self.bytes_loaded, bytesTotal=self.bytes_total)


def stage_progress(address: str, *, stage: int, timeout: float = PROBE_TIMEOUT_SECONDS) -> StageLoad | None:
    with grpc.insecure_channel(address) as channel:
        try:
            status = stage_pb2_grpc.StageStub(channel).GetLoadStatus(stage_pb2.LoadStatusRequest(), timeout=timeout)
        except grpc.RpcError:
            return None
    return StageLoad(stage=stage, bytes_loaded=status.bytes_loaded, bytes_total=status.bytes_total, error=status.error)


def load_progress(pods: Iterable[Mapping[str, Any]]) -> list[StageLoad]:
    """One entry per stage pod (a camelCase dict) that has an IP and answers."""
    found = []
    for pod in pods:
        ip = (pod.get("status") or {}).get("podIP")
        if not ip:
            continue
        entry = stage_progress(f"{ip}:{STAGE_PORT}", stage=int(pod["metadata"]["labels"][LABEL_STAGE]))
        if entry is not None:
            found.append(entry)
    return sorted(found, key=lambda e: e.stage)


def load_failure(loads: Sequence[StageLoad]) -> str | None:
    """What failed, stage by stage ("stage 1 failed to load: ..."), or None while no stage reports a failure. It fits
    in a condition's message however many stages fail."""
    ordered = sorted(loads, key=lambda e: e.stage)
    failed = [
        f"stage {load.stage} failed to load: {_shortened(load.error, MAX_STAGE_ERROR_CHARS)}"
        for load in ordered
        if load.error
    ]
    return _shortened("; ".join(failed), MAX_CONDITION_MESSAGE_CHARS) or None


def _shortened(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[: limit - 1] + "…"
