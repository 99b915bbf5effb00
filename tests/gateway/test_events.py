"""Recording an Event never holds up or breaks the gateway: an API server that is down or hangs costs a log line.

The serving path calls EventRecorder.fenced from the pipeline driver; it must return at once whatever the API server
does. The Event itself reaching a real API server is tested in tests/coordination/test_takeover.py.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from kubernetes import client
from strata.gateway.events import DeploymentRef, EventRecorder
from strata.lease import FencingToken

FENCE = FencingToken(lease_uid="lease-1", term=4, holder="gateway-a-1f2e3d")
TIMEOUT_S = 0.5


@contextmanager
def refusing() -> Iterator[str]:
    """An address where nothing listens: connections are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    yield f"http://127.0.0.1:{port}"


@contextmanager
def hanging() -> Iterator[str]:
    """An address that accepts connections and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def _recorder(host: str) -> EventRecorder:
    configuration = client.Configuration()
    configuration.host = host
    configuration.retries = False
    return EventRecorder(
        api=client.CoreV1Api(client.ApiClient(configuration)),
        deployment=DeploymentRef(namespace="team-a", name="llama", uid="u-1"),
        reporter="gateway-a",
        timeout_s=TIMEOUT_S,
    )


@pytest.mark.parametrize(
    "server",
    [
        pytest.param(refusing, id="an API server that refuses connections"),
        pytest.param(hanging, id="an API server that accepts and never answers"),
    ],
)
def test_a_refusal_is_reported_at_once_and_a_failed_post_is_only_logged(
    server: object, caplog: pytest.LogCaptureFixture
) -> None:
    assert callable(server)
    caplog.set_level(logging.INFO, logger="strata.gateway.events")
    with server() as host:
        recorder = _recorder(host)
        started = time.monotonic()
        recorder.fenced(FENCE, "stage 1: term 4 is older than the accepted term 5")
        assert time.monotonic() - started < 0.1, "the caller never waits for the API server"
        deadline = time.monotonic() + TIMEOUT_S + 5
        while "could not record Event CoordinatorFenced" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.05)
        recorder.close()
    assert "on ModelDeployment team-a/llama" in caplog.text


def test_a_closed_recorder_drops_the_event_without_raising(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="strata.gateway.events")
    with refusing() as host:
        recorder = _recorder(host)
        recorder.close()
        recorder.fenced(FENCE, "stage 0: term 4 is older than the accepted term 5")
    assert "not recording Event CoordinatorFenced (shutting down)" in caplog.text
