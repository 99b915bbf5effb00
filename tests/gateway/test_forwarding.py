"""A standby gateway replica serves by forwarding to the coordinating one (strata.gateway.forwarding).

The pure parts as tables: which address the Lease gives a standby, and where a request goes. Then two replicas: a
real `strata serve` coordinates one stage, and an in-process standby (its own pipeline never promoted) answers
completions, plain and streamed, with the coordinator's output; a standby whose coordinator does not answer, or that
was handed a request already forwarded, answers a retryable 503.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from strata.gateway.app import create_app
from strata.gateway.coordination import Coordinator
from strata.gateway.errors import NotReadyError
from strata.gateway.forwarding import (
    COORDINATOR_ANNOTATION,
    FORWARDED_HEADER,
    Forward,
    Local,
    Relay,
    advertisement,
    coordinator_url,
    route,
)
from strata.gateway.server import build
from strata.gateway.settings import GatewaySettings
from strata.gguf.header import GGUFHeader
from strata.lease import FencingToken, LeaseTiming, LeaseView
from strata_testbed.serve import Served

ME, HOLDER = "gateway-b-222222", "gateway-a-111111"
URL = "http://10.0.0.7:8000"


@pytest.mark.parametrize(
    ("view", "expected"),
    [
        pytest.param(LeaseView(HOLDER, advertisement(identity=HOLDER, url=URL)), URL, id="the holder's own address"),
        pytest.param(None, None, id="no Lease read yet gives nothing"),
        pytest.param(LeaseView("", {}), None, id="a Lease nobody holds gives nothing"),
        pytest.param(
            LeaseView(ME, advertisement(identity=ME, url=URL)), None, id="this replica holding it gives nothing"
        ),
        pytest.param(
            LeaseView(HOLDER, advertisement(identity="gateway-old-000000", url=URL)),
            None,
            id="an address an earlier holder left behind is not used",
        ),
        pytest.param(LeaseView(HOLDER, {}), None, id="a holder that wrote no address gives nothing"),
        pytest.param(
            LeaseView(HOLDER, {COORDINATOR_ANNOTATION: HOLDER}),
            None,
            id="the holder's name with no address gives nothing",
        ),
    ],
)
def test_a_standby_takes_the_coordinator_address_only_from_the_current_holder(
    view: LeaseView | None, expected: str | None
) -> None:
    assert coordinator_url(view, identity=ME) == expected


def test_a_coordinator_with_no_address_advertises_nothing() -> None:
    assert advertisement(identity=HOLDER, url="") == {}


@pytest.mark.parametrize(
    ("coordinating", "coordinator", "forwarded", "expected"),
    [
        pytest.param(True, None, False, Local(), id="the coordinator serves a request itself"),
        pytest.param(True, None, True, Local(), id="the coordinator serves a forwarded request itself"),
        pytest.param(False, URL, False, Forward(URL), id="a standby forwards to the coordinator it knows"),
        pytest.param(False, None, False, "no coordinating", id="a standby that knows none refuses with a 503"),
        pytest.param(False, URL, True, "no longer coordinates", id="a forwarded request is never forwarded again"),
    ],
)
def test_where_a_request_goes(coordinating: bool, coordinator: str | None, forwarded: bool, expected: object) -> None:
    if isinstance(expected, str):
        with pytest.raises(NotReadyError, match=expected) as refused:
            route(coordinating=coordinating, coordinator=coordinator, forwarded=forwarded)
        assert refused.value.status == 503
        assert refused.value.headers() == {"Retry-After": "1"}
    else:
        assert route(coordinating=coordinating, coordinator=coordinator, forwarded=forwarded) == expected


def standby(header: GGUFHeader, coordinator: str | None) -> tuple[FastAPI, Relay]:
    """A replica that does not hold the Lease and has read that the coordinator is at `coordinator`."""
    settings = GatewaySettings(model_url="unused.gguf", first_stage="127.0.0.1:9", context=1024)
    _app, serving = build(settings, header=header)
    relay = Relay(connect_timeout_s=2, reply_timeout_s=60)
    annotations = advertisement(identity=HOLDER, url=coordinator) if coordinator else {}
    relay.observe(coordinating=False, view=LeaseView(HOLDER, annotations), identity=ME)
    return create_app(serving, relay=relay), relay


async def ask(app: FastAPI, method: str, path: str, **kwargs: Any) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://standby") as client:
        return await client.request(method, path, timeout=60, **kwargs)


def streamed_text(body: str) -> str:
    events = [line.removeprefix("data: ") for line in body.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", body
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"])


def test_a_standby_answers_completions_with_the_coordinators_output(
    one_stage: Served, qwen2_header: GGUFHeader
) -> None:
    request = {"model": one_stage.model, "prompt": [100, 200, 300, 42], "max_tokens": 8, "temperature": 0}
    direct = httpx.post(f"{one_stage.base_url}/completions", json=request, timeout=60)
    assert direct.status_code == 200, direct.text
    expected = direct.json()["choices"][0]["text"]
    app, relay = standby(qwen2_header, one_stage.root)

    async def scenario() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        try:
            ready = await ask(app, "GET", "/readyz")
            plain = await ask(app, "POST", "/v1/completions", json=request)
            stream = await ask(app, "POST", "/v1/completions", json=request | {"stream": True})
            return ready, plain, stream
        finally:
            await relay.close()

    ready, plain, stream = asyncio.run(scenario())
    assert ready.status_code == 200
    assert one_stage.root in ready.json()["status"]
    assert plain.status_code == 200, plain.text
    assert plain.json()["choices"][0]["text"] == expected
    assert stream.status_code == 200, stream.text
    assert stream.headers["content-type"].startswith("text/event-stream")
    assert streamed_text(stream.text) == expected


def test_the_coordinators_own_refusals_come_back_unchanged(one_stage: Served, qwen2_header: GGUFHeader) -> None:
    app, relay = standby(qwen2_header, one_stage.root)

    async def scenario() -> httpx.Response:
        try:
            return await ask(app, "POST", "/v1/completions", json={"model": "no-such-model", "prompt": "hi"})
        finally:
            await relay.close()

    refused = asyncio.run(scenario())
    assert refused.status_code == 404
    assert refused.json()["error"]["code"] == "model_not_found"


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize(
    ("coordinator", "headers", "reason"),
    [
        pytest.param("gone", {}, "did not answer", id="a coordinator that refuses the connection"),
        pytest.param(None, {}, "no coordinating", id="no coordinator known"),
        pytest.param("gone", {FORWARDED_HEADER: "1"}, "no longer coordinates", id="a request already forwarded"),
    ],
)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_standby_that_cannot_forward_answers_a_retryable_503(
    qwen2_header: GGUFHeader, coordinator: str | None, headers: dict[str, str], reason: str, stream: bool
) -> None:
    url = f"http://127.0.0.1:{closed_port()}" if coordinator == "gone" else None
    app, relay = standby(qwen2_header, url)
    request = {"model": "strata-test-qwen2", "prompt": "hi", "max_tokens": 2, "stream": stream}

    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        try:
            answer = await ask(app, "POST", "/v1/completions", json=request, headers=headers)
            return answer, await ask(app, "GET", "/readyz")
        finally:
            await relay.close()

    answer, ready = asyncio.run(scenario())
    assert answer.status_code == 503, answer.text
    assert answer.headers["retry-after"] == "1"
    assert reason in answer.json()["error"]["message"]
    assert ready.status_code == (503 if url is None else 200)


class ScriptedElector:
    """An elector whose rounds return the tokens and Lease views of a script, one pair a round."""

    def __init__(self, rounds: list[tuple[FencingToken | None, LeaseView | None]]) -> None:
        self.identity = ME
        self.timing = LeaseTiming(duration_seconds=3, renew_deadline_seconds=2.0, retry_period_seconds=0.5)
        self.annotations: dict[str, str] = {}
        self.observed: LeaseView | None = None
        self._rounds = iter(rounds)

    def try_acquire_or_renew(self) -> FencingToken | None:
        token, self.observed = next(self._rounds)
        return token

    def release(self) -> None:
        pass


class Standing:
    """The pipelines as the election sees them; only what a round reads and calls."""

    deposed = True
    fence: FencingToken | None = None

    def promote(self, fence: FencingToken, *, valid_until: float = 0.0) -> None:
        self.fence, self.deposed = fence, False

    def extend(self, *, valid_until: float) -> None:
        pass

    def step_down(self, reason: str) -> None:
        self.deposed = True


def test_each_election_round_tells_the_relay_who_serves() -> None:
    """Standby behind A; then A's address is gone; then this replica wins; then it loses the Lease to A again."""
    theirs = LeaseView(HOLDER, advertisement(identity=HOLDER, url=URL))
    mine = FencingToken(lease_uid="lease", term=2, holder=ME)
    rounds = [(None, theirs), (None, LeaseView(HOLDER, {})), (mine, LeaseView(ME, {})), (None, theirs)]
    relay = Relay()
    coordinator = Coordinator(elector=ScriptedElector(rounds), pipeline=Standing(), relay=relay)  # type: ignore[arg-type]

    async def rounds_seen() -> list[tuple[bool, str | None]]:
        seen = []
        for _ in rounds:
            await coordinator.round()
            seen.append((relay.coordinating, relay.coordinator))
        await relay.close()
        return seen

    assert asyncio.run(rounds_seen()) == [(False, URL), (False, None), (True, None), (False, URL)]
