"""Which pipelines serve: read from the ModelDeployment's status, followed by polling it.

The operator lists each pipeline in status.pipelines with the plan it serves and whether every stage of that plan is
ready; the gateway drives the ready ones. It reads its own ModelDeployment (`get`, narrowed to that one name in the
gateway's Role) rather than the pipelines ConfigMap that holds the same list: the API server lets the operator grant
only what it holds itself, and it holds `get` on ModelDeployments but, deliberately, no read of ConfigMaps (in
cluster-wide mode that would be every ConfigMap of the cluster). A mounted ConfigMap needs no grant, but the kubelet
refreshes one only every minute or so, and the test bed's pod runner mounts no volumes. A first stage's address
follows from the pipeline's plan generation by the naming rule both sides share (strata.modeldeployment).

Polling, not a watch: one small GET per period (the election's retry period, 2 s by default) beside the Lease
renewal the gateway already makes, with no long-lived stream to resume. A pipeline that is lost is noticed sooner by
its driver (its stages stop answering); the list only adds pipelines and takes away the ones the operator retired.
A read that fails keeps the list as it was: the API server being away says nothing about the stages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from strata.draining import LIST_READ_TIMEOUT_S
from strata.gateway.cold_start import load_report
from strata.gateway.pipelines import PipelineEntry
from strata.modeldeployment import GROUP, PLURAL, VERSION, stage_address
from urllib3.exceptions import HTTPError

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = LIST_READ_TIMEOUT_S  # the operator's bound on keeping a retired pipeline counts on it


class PipelineListError(ValueError):
    """The status lists pipelines in a shape this gateway cannot read; the message says where."""


def _number(value: object, *, where: str, least: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise PipelineListError(f"{where} must be an integer of at least {least}, not {value!r}")
    return value


def serving_pipelines(status: Mapping[str, Any], *, deployment: str, namespace: str) -> list[PipelineEntry] | None:
    """The ready pipelines of a ModelDeployment's status, by index; None when the status lists no pipelines yet."""
    listed = status.get("pipelines")
    if listed is None:
        return None
    if not isinstance(listed, list):
        raise PipelineListError(f"status.pipelines must be a list, not {type(listed).__name__}")
    entries = []
    for position, item in enumerate(listed):
        where = f"status.pipelines[{position}]"
        if not isinstance(item, Mapping):
            raise PipelineListError(f"{where} must be an object")
        serving = item.get("serving")
        if item.get("ready") is not True or not isinstance(serving, Mapping):
            continue
        generation = _number(serving.get("generation"), where=f"{where}.serving.generation", least=0)
        entries.append(
            PipelineEntry(
                index=_number(item.get("index"), where=f"{where}.index", least=0),
                generation=generation,
                first_stage=stage_address(deployment, namespace, generation=generation, index=0),
                parallel=_number(serving.get("parallel"), where=f"{where}.serving.parallel", least=1),
                context=_number(serving.get("contextLength"), where=f"{where}.serving.contextLength", least=2),
            )
        )
    indices = [e.index for e in entries]
    if len(set(indices)) != len(indices):
        raise PipelineListError(f"status.pipelines names an index twice: {sorted(indices)}")
    return sorted(entries, key=lambda e: e.index)


class DeploymentPipelines:
    """Reads the serving pipelines from one ModelDeployment (blocking: call it from a worker thread)."""

    def __init__(self, *, api: client.CustomObjectsApi, namespace: str, name: str) -> None:
        self._api = api
        self.namespace = namespace
        self.name = name
        self.report: dict[str, object] | None = None  # the load under way, from the last read (cold starts tell it)

    def read(self) -> list[PipelineEntry] | None:
        body = self._api.get_namespaced_custom_object(
            group=GROUP,
            version=VERSION,
            namespace=self.namespace,
            plural=PLURAL,
            name=self.name,
            _request_timeout=REQUEST_TIMEOUT_S,
        )
        status = body.get("status") or {}
        self.report = load_report(status)
        return serving_pipelines(status, deployment=self.name, namespace=self.namespace)


class PipelineFollower:
    """Polls `read` every `period_s` and hands each list that differs from the last to `apply`."""

    def __init__(
        self,
        *,
        read: Callable[[], Sequence[PipelineEntry] | None],
        apply: Callable[[Sequence[PipelineEntry]], Awaitable[None]],
        period_s: float,
        source: str,
    ) -> None:
        self._read = read
        self._apply = apply
        self.period_s = period_s
        self.source = source  # what `read` reads, for the log
        self._last: tuple[PipelineEntry, ...] | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="pipeline-follower")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(self.period_s)

    async def poll(self) -> None:
        """One read; public so a test can poll without waiting for the period."""
        try:
            entries = await asyncio.to_thread(self._read)
        except (ApiException, HTTPError, OSError, PipelineListError) as error:
            log.warning(
                "cannot read the serving pipelines from %s, keeping the ones driven now: %s", self.source, error
            )
            return
        if entries is None:
            return  # nothing listed yet: the pipeline from the settings stays
        current = tuple(entries)
        if current == self._last:
            return
        self._last = current
        log.info("serving pipelines from %s: %s", self.source, [(e.index, e.generation) for e in current] or "none")
        await self._apply(current)
