"""Every gateway replica serves: a standby forwards each request to the replica that holds the coordinator Lease.

Only the Lease holder drives the stages (its term fences them), so a standby cannot run a request itself; it relays
it instead. The coordinator writes its own address on the Lease with every renewal, prefixed by its holder identity
(`COORDINATOR_ANNOTATION`: "IDENTITY URL"); each standby reads the Lease every round of the election anyway, so it
learns the address without a call, a watch or RBAC of its own, and an address left behind by an earlier holder (whose
identity no longer matches the holder's) is never used. The Lease names a pod, not an address; resolving the pod
would need read access to pods, and the pod's own IP comes free from the downward API.

What a request meets (`route`, a pure table): the coordinator serves it; a standby that knows the coordinator
forwards it; a standby that does not answers 503 with Retry-After, as does one the coordinator does not answer
(refused, or no reply within the deadline). A forwarded request carries `FORWARDED_HEADER` and is never forwarded
again: a replica that got one but no longer coordinates (the Lease just moved) refuses it with a retryable 503 rather
than bounce it on. So a request is served once, or the client hears a retryable error; none is dropped unanswered.
A stream that breaks after it began ends with an error event, as a local stream's failure does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from strata.gateway.errors import NotReadyError
from strata.gateway.serving import sse
from strata.lease import LeaseView

COORDINATOR_ANNOTATION = "strata.dev/coordinator"
FORWARDED_HEADER = "x-strata-forwarded"
# What a forwarded request takes along, and what its answer brings back; hop-by-hop and length headers are redone.
REQUEST_HEADERS = ("authorization", "content-type", "accept")
REPLY_HEADERS = ("content-type", "retry-after", "cache-control")


@dataclass(frozen=True)
class Local:
    """Serve it here: this replica coordinates, or there is no election."""


@dataclass(frozen=True)
class Forward:
    url: str  # the coordinator's base URL, http://HOST:PORT


def advertisement(*, identity: str, url: str) -> dict[str, str]:
    """What the coordinator writes on the Lease; nothing when it has no address to give."""
    return {COORDINATOR_ANNOTATION: f"{identity} {url}"} if url else {}


def coordinator_url(view: LeaseView | None, *, identity: str) -> str | None:
    """The address of the Lease's holder when another replica holds it and wrote its address under its own name."""
    if view is None or not view.holder or view.holder == identity:
        return None
    named, _, url = view.annotations.get(COORDINATOR_ANNOTATION, "").partition(" ")
    return url if named == view.holder and url else None


def route(*, coordinating: bool, coordinator: str | None, forwarded: bool) -> Local | Forward:
    """Where a request goes; NotReadyError (503 + Retry-After) when it can go nowhere now."""
    if coordinating:
        return Local()
    if forwarded:
        raise NotReadyError("forwarded to a gateway replica that no longer coordinates; retry", retry_after_s=1)
    if coordinator is None:
        raise NotReadyError("standby: no coordinating gateway replica is known yet", retry_after_s=1)
    return Forward(coordinator)


class Relay:
    """A replica's view of the election (updated each round, strata.gateway.coordination) and its forwarding client.

    `connect_timeout_s` bounds reaching the coordinator; `reply_timeout_s` bounds each wait for its bytes (for a
    non-streaming request that is the whole generation, for a stream the gap between two events)."""

    def __init__(self, *, connect_timeout_s: float = 2.0, reply_timeout_s: float = 600.0) -> None:
        self.coordinating = False
        self.coordinator: str | None = None
        timeout = httpx.Timeout(reply_timeout_s, connect=connect_timeout_s, pool=connect_timeout_s)
        self._http = httpx.AsyncClient(timeout=timeout)

    def observe(self, *, coordinating: bool, view: LeaseView | None, identity: str) -> None:
        self.coordinating = coordinating
        self.coordinator = None if coordinating else coordinator_url(view, identity=identity)

    def route(self, request: Request) -> Local | Forward:
        forwarded = FORWARDED_HEADER in request.headers
        return route(coordinating=self.coordinating, coordinator=self.coordinator, forwarded=forwarded)

    async def close(self) -> None:
        await self._http.aclose()

    async def forward(self, to: Forward, request: Request, *, stream: bool) -> Response:
        """The coordinator's answer to `request`, status and body as it gave them; a stream relayed as it comes."""
        headers = {k: v for k in REQUEST_HEADERS if (v := request.headers.get(k)) is not None}
        outgoing = self._http.build_request(
            "POST", to.url + request.url.path, content=await request.body(), headers=headers | {FORWARDED_HEADER: "1"}
        )
        try:
            reply = await self._http.send(outgoing, stream=True)
        except httpx.HTTPError as exc:
            raise unanswered(to, exc) from exc
        kept = {k: v for k in REPLY_HEADERS if (v := reply.headers.get(k)) is not None}
        if not stream or reply.status_code != 200:
            try:
                body = await reply.aread()
            except httpx.HTTPError as exc:
                raise unanswered(to, exc) from exc
            finally:
                await reply.aclose()
            return Response(body, status_code=reply.status_code, headers=kept)

        async def relayed() -> AsyncIterator[bytes]:
            try:
                async for chunk in reply.aiter_raw():
                    yield chunk
            except httpx.HTTPError as exc:
                yield sse(unanswered(to, exc).body()).encode()
            finally:
                await reply.aclose()

        return StreamingResponse(relayed(), status_code=200, headers=kept, media_type="text/event-stream")


def unanswered(to: Forward, exc: httpx.HTTPError) -> NotReadyError:
    return NotReadyError(f"the coordinating gateway replica at {to.url} did not answer: {exc!r}", retry_after_s=1)
