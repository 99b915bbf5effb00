"""The gateway replicas' election: one Lease per deployment, its holder drives the pipelines, the others stand by.

Each round (every retry period) the elector renews or tries to take the Lease; the Kubernetes client blocks, so the
round runs in a worker thread while the event loop keeps serving. What a round decides goes to the pipeline (or to
every pipeline of the deployment at once, strata.gateway.pipelines: one term fences them all):

- won with a new token (Lease uid, term): `promote`, and the driver claims the stages with that term;
- renewed: `extend` the token's validity to the start of this round plus the renew deadline, so a replica frozen
  or cut off from the API server stops using its term on its own clock, before the Lease expires for the others;
- lost (another holder, or no renewal within the deadline): `step_down` at once.

The pipeline may also step down by itself, when a stage refuses its term with FAILED_PRECONDITION; the Lease is
then released so that a replica which can claim the stages (possibly this one, with a higher term) takes over.
After every round the relay hears whether this replica coordinates and what the Lease says of the one that does: a
standby forwards requests there and is ready while it knows where (strata.gateway.forwarding). On shutdown the
Lease is released so a standby takes over at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from kubernetes import client, config
from strata.gateway.forwarding import Relay
from strata.lease import FencingToken, LeaseElector, LeaseTiming

log = logging.getLogger(__name__)


def kube_client() -> client.ApiClient:
    """In a pod, its ServiceAccount token; elsewhere (tests, a laptop) the kubeconfig that KUBECONFIG names."""
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()
        return client.ApiClient()
    return config.new_client_from_config()


class Coordinated(Protocol):
    """What the election drives: one pipeline's driver (strata.gateway.pipeline) or all of them."""

    @property
    def deposed(self) -> bool: ...

    @property
    def fence(self) -> FencingToken | None: ...

    def promote(self, fence: FencingToken, *, valid_until: float = ...) -> None: ...

    def extend(self, *, valid_until: float) -> None: ...

    def step_down(self, reason: str) -> None: ...


class Coordinator:
    def __init__(
        self,
        *,
        elector: LeaseElector,
        pipeline: Coordinated,
        annotate: Callable[[], Mapping[str, str]] | None = None,
        relay: Relay | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`annotate`: what to write on the Lease with each round (the demand the operator scales on), taken on the
        event loop, where the figures it reads change, before the round goes to its worker thread."""
        self.elector = elector
        self.pipeline = pipeline
        self.annotate = annotate
        self.relay = relay
        self._wake = asyncio.Event()
        self._clock = clock
        self._token: FencingToken | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def token(self) -> FencingToken | None:
        """The token of the Lease this replica holds, None while it stands by."""
        return self._token

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="coordinator-election")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._token is not None:
            self.pipeline.step_down("the gateway is shutting down")
            self._token = None
            await asyncio.to_thread(self.elector.release)
            log.info("released the coordinator Lease")

    def wake(self) -> None:
        """Run the next round now rather than at the end of the retry period: what `annotate` says has just changed
        in a way the operator should hear at once (a request held with no pipeline serving)."""
        self._wake.set()

    async def _run(self) -> None:
        timing = self.elector.timing
        while True:
            self._wake.clear()
            await self.round()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=timing.retry_period_seconds)

    async def round(self) -> None:
        """One election round; public so a test can drive rounds without waiting for the period."""
        await self._elect()
        if self.relay is not None:
            self.relay.observe(
                coordinating=self._token is not None, view=self.elector.observed, identity=self.elector.identity
            )

    async def _elect(self) -> None:
        if self._token is not None and self.pipeline.deposed and self.pipeline.fence == self._token:
            # A stage refused our term: someone holds a newer one, or we cannot drive this pipeline. Let go.
            log.warning("the pipeline refused term %d; releasing the coordinator Lease", self._token.term)
            self._token = None
            await asyncio.to_thread(self.elector.release)
            return
        started = self._clock()
        if self.annotate is not None:
            self.elector.annotations = self.annotate()
        token = await asyncio.to_thread(self.elector.try_acquire_or_renew)
        valid_until = started + self.elector.timing.renew_deadline_seconds
        if token is None:
            if self._token is not None:
                self._token = None
                self.pipeline.step_down("lost the coordinator Lease (taken over, or not renewed within the deadline)")
            return
        if token != self._token:
            log.info("elected coordinator: term %d of Lease %s as %s", token.term, token.lease_uid, token.holder)
            self._token = token
            self.pipeline.promote(token, valid_until=valid_until)
            return
        self.pipeline.extend(valid_until=valid_until)


def build_elector(*, namespace: str, name: str, identity: str, timing: LeaseTiming) -> LeaseElector:
    return LeaseElector(
        api=client.CoordinationV1Api(kube_client()), namespace=namespace, name=name, identity=identity, timing=timing
    )
