"""Load progress of a deployment's stages, asked of each stage pod over gRPC.

A stage loads gigabytes before it turns ready; the operator folds each stage's bytes loaded over bytes needed into
the ModelDeployment's status so `kubectl get -o yaml` shows where a slow start stands. A stage that does not
answer within the timeout simply has no entry this time.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
from strata.operator.names import LABEL_STAGE, STAGE_PORT
from strata.operator.status import LoadProgress
from strata.rpc.v1 import stage_pb2, stage_pb2_grpc

PROBE_TIMEOUT_SECONDS = 1.0


def stage_progress(address: str, *, stage: int, timeout: float = PROBE_TIMEOUT_SECONDS) -> LoadProgress | None:
    with grpc.insecure_channel(address) as channel:
        try:
            status = stage_pb2_grpc.StageStub(channel).GetLoadStatus(stage_pb2.LoadStatusRequest(), timeout=timeout)
        except grpc.RpcError:
            return None
    return LoadProgress(stage=stage, bytesLoaded=status.bytes_loaded, bytesTotal=status.bytes_total)


def load_progress(pods: Iterable[Any]) -> list[LoadProgress]:
    """One entry per stage pod that has an IP and answers."""
    found = []
    for pod in pods:
        ip = pod.status.pod_ip if pod.status else None
        if not ip:
            continue
        entry = stage_progress(f"{ip}:{STAGE_PORT}", stage=int(pod.metadata.labels[LABEL_STAGE]))
        if entry is not None:
            found.append(entry)
    return sorted(found, key=lambda e: e.stage)
