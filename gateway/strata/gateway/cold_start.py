"""Requests that arrive while no pipeline serves: held for a bounded time while one loads, then a 503 that says how
far the load has got. Never an unbounded wait.

A deployment with spec.autoscaling may have no pipeline (minReplicas 0) or only loading ones. The coordinator gateway
stays ready (it holds the Lease and so reports the demand), takes the request, counts it as held, and waits for a
pipeline to serve; the count goes into the demand it writes on the coordinator Lease (strata.demand), on which the
operator brings a pipeline up. A request still held after `wait_s` is answered 503 with `Retry-After` and the
deployment's load progress as the operator last published it (phase, pipelines, bytes loaded of bytes to load).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from strata.gateway.errors import ColdStartTimeoutError


class Serves(Protocol):
    """What a held request waits on: strata.gateway.pipelines.Pipelines."""

    async def wait_ready(self, within_s: float) -> bool: ...


def load_report(status: Mapping[str, Any]) -> dict[str, object]:
    """What a ModelDeployment's status says about a load under way, for a client that waits."""
    progress = status.get("loadProgress") or []
    loaded = sum(int(p.get("bytesLoaded") or 0) for p in progress if isinstance(p, Mapping))
    total = sum(int(p.get("bytesTotal") or 0) for p in progress if isinstance(p, Mapping))
    autoscaling = status.get("autoscaling") or {}
    return {
        "phase": status.get("phase"),
        "replicas": status.get("replicas", 0),
        "readyReplicas": status.get("readyReplicas", 0),
        "bytesLoaded": loaded,
        "bytesTotal": total,
        "autoscaling": autoscaling.get("reason"),
    }


class ColdStart:
    def __init__(self, *, wait_s: float, retry_after_s: int, progress: Callable[[], dict[str, object] | None]) -> None:
        if wait_s <= 0 or retry_after_s < 1:
            raise ValueError(f"a cold start needs a positive wait and Retry-After, not {wait_s} and {retry_after_s}")
        self.wait_s = wait_s
        self.retry_after_s = retry_after_s
        self._progress = progress
        self.held = 0  # requests waiting for a pipeline to serve: the demand that scales up from zero
        # Called when a request starts waiting, so the demand reaches the operator now, not at the next renewal.
        self.listeners: list[Callable[[], None]] = []

    async def hold(self, pipelines: Serves) -> None:
        """Return once a pipeline serves; ColdStartTimeoutError once `wait_s` has passed without one."""
        self.held += 1
        for listener in self.listeners:
            listener()
        try:
            if await pipelines.wait_ready(self.wait_s):
                return
        finally:
            self.held -= 1
        progress = self._progress() or {"phase": None}
        raise ColdStartTimeoutError(
            f"no pipeline serves yet and none came within {self.wait_s:g} s; a pipeline is being brought up, "
            "retry shortly",
            retry_after_s=self.retry_after_s,
            progress=progress,
        )
