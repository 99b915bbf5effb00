"""Two real `strata gateway` processes electing on a real Lease in front of one real pipeline of stages.

The leader is frozen with SIGSTOP past the Lease duration: the standby takes the Lease with a higher term, claims
the stages and becomes ready. Resumed, the old leader finds its term lapsed or refused and steps down (not ready).
Requests sent to both throughout either complete with the healthy pipeline's output or fail with a retryable
429/503 carrying Retry-After; none comes back with other output.

A standby whose coordinator writes its address on the Lease is ready and answers completions, plain and streamed,
with the coordinator's output, by forwarding them.

A gateway whose term a stage refuses records a CoordinatorFenced Event on its ModelDeployment, naming the term and the
stage, and climbs to a term the stages accept.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from kubernetes import client
from strata.modeldeployment import API_VERSION, COORDINATOR_FENCED, KIND
from strata.stage_worker.fencing import Holder
from strata.stage_worker.server import RunningStage
from strata_testbed.controlplane import ControlPlane, free_port
from strata_testbed.processes import ManagedProcess

DURATION_S, RENEW_DEADLINE_S, RETRY_PERIOD_S = 3, 2.0, 0.5
REQUEST = {"model": "qwen2", "prompt": [100, 200, 300, 42], "max_tokens": 8, "temperature": 0}


@dataclass
class Gateway:
    process: ManagedProcess
    url: str

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False


@dataclass
class Outcomes:
    """What the clients saw: completed texts, and (status, Retry-After) of every refusal."""

    texts: list[str] = field(default_factory=list)
    refusals: list[tuple[int, str | None]] = field(default_factory=list)
    other: list[str] = field(default_factory=list)


def _start_gateway(
    *,
    name: str,
    model: Path,
    stages: list[RunningStage],
    plane: ControlPlane,
    lease: str,
    log_dir: Path,
    extra_env: dict[str, str] | None = None,
) -> Gateway:
    settings = stages[0].service.settings
    env = {
        "KUBECONFIG": str(plane.kubeconfig),
        "STRATA_MODEL_URL": str(model),
        "STRATA_MODEL_NAME": "qwen2",
        "STRATA_FIRST_STAGE": f"127.0.0.1:{stages[0].port}",
        "STRATA_CONTEXT": str(settings.context),
        "STRATA_PARALLEL": str(settings.parallel),
        "STRATA_LISTEN": "127.0.0.1:0",
        "STRATA_LEASE_NAME": lease,
        "STRATA_LEASE_NAMESPACE": "default",
        "STRATA_LEASE_DURATION_SECONDS": str(DURATION_S),
        "STRATA_RENEW_DEADLINE_SECONDS": str(RENEW_DEADLINE_S),
        "STRATA_RETRY_PERIOD_SECONDS": str(RETRY_PERIOD_S),
        "STRATA_POD_NAME": name,
    } | (extra_env or {})
    process = ManagedProcess(name=name, argv=[sys.executable, "-m", "strata.cli", "gateway"], log_dir=log_dir, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.running():
        found = re.search(r"on (http://[\d.]+:\d+)/v1", process.log_tail(200))
        if found:
            return Gateway(process=process, url=found.group(1))
        time.sleep(0.1)
    process.stop()
    raise RuntimeError(f"gateway {name} did not start:\n{process.log_tail()}")


def _wait(predicate: object, *, timeout_s: float, what: str) -> float:
    """Seconds until `predicate()` held."""
    assert callable(predicate)
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout_s, f"timed out waiting until {what}"
        time.sleep(0.05)
    return time.monotonic() - started


def _clients(gateways: list[Gateway], outcomes: Outcomes, stop: threading.Event) -> Iterator[threading.Thread]:
    """One client per gateway, sending the reference request again and again, as a load balancer's targets see."""

    def loop(gateway: Gateway) -> None:
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                try:
                    reply = http.post(f"{gateway.url}/v1/completions", json=REQUEST)
                except httpx.HTTPError as exc:
                    outcomes.other.append(f"{gateway.process.name}: {exc!r}")
                    continue
                if reply.status_code == 200:
                    outcomes.texts.append(reply.json()["choices"][0]["text"])
                elif reply.status_code in (429, 503):
                    outcomes.refusals.append((reply.status_code, reply.headers.get("retry-after")))
                    time.sleep(0.1)
                else:
                    outcomes.other.append(f"{gateway.process.name}: {reply.status_code} {reply.text}")

    for gateway in gateways:
        thread = threading.Thread(target=loop, args=(gateway,), daemon=True)
        thread.start()
        yield thread


@pytest.mark.cluster
def test_a_frozen_leader_is_replaced_with_a_higher_term_and_steps_down_when_it_wakes(
    control_plane: ControlPlane, api_client: client.ApiClient, model: Path, stages: list[RunningStage], tmp_path: Path
) -> None:
    lease = f"takeover-{uuid.uuid4().hex[:6]}"
    leases = client.CoordinationV1Api(api_client)
    common = {"model": model, "stages": stages, "plane": control_plane, "lease": lease, "log_dir": tmp_path}
    first = _start_gateway(name="gateway-a", **common)  # type: ignore[arg-type]
    started: list[Gateway] = [first]
    stop = threading.Event()
    try:
        _wait(first.ready, timeout_s=60, what="the first gateway is elected and ready")
        second = _start_gateway(name="gateway-b", **common)  # type: ignore[arg-type]
        started.append(second)
        _wait(lambda: "standby" in httpx.get(f"{second.url}/readyz").text, timeout_s=30, what="the second stands by")
        assert httpx.get(f"{second.url}/readyz").status_code == 503
        reference = httpx.post(f"{first.url}/v1/completions", json=REQUEST, timeout=60).json()["choices"][0]["text"]
        before = leases.read_namespaced_lease(name=lease, namespace="default").spec
        assert before.holder_identity.startswith("gateway-a-")

        outcomes = Outcomes()
        threads = list(_clients([first, second], outcomes, stop))
        time.sleep(1.0)
        frozen_at = time.monotonic()
        first.process.pause()
        takeover_s = _wait(second.ready, timeout_s=DURATION_S + 15, what="the standby takes over and is ready")
        after = leases.read_namespaced_lease(name=lease, namespace="default").spec
        assert after.holder_identity.startswith("gateway-b-")
        assert after.lease_transitions == before.lease_transitions + 1
        assert [s.service.fence.accepted_term for s in stages] == [after.lease_transitions] * 2
        time.sleep(1.0)  # the new coordinator serves for a while before the old one wakes
        first.process.resume()
        paused_s = time.monotonic() - frozen_at
        _wait(lambda: not first.ready(), timeout_s=10, what="the old leader steps down")
        time.sleep(1.0)
        assert not first.ready(), "the old leader stays down: it no longer holds the Lease"
        assert second.ready()
        stop.set()
        for thread in threads:
            thread.join(timeout=60)

        assert outcomes.other == [], "every request completed or was refused with a retryable status"
        assert outcomes.texts, "requests completed during the test"
        assert set(outcomes.texts) == {reference}, "no request came back with output other than the reference"
        assert all(retry_after is not None for _status, retry_after in outcomes.refusals)
        log = first.process.log_tail(400)
        assert "stepping down" in log or "stepped down" in log, log
        print(
            f"takeover {takeover_s:.2f} s after SIGSTOP (lease {DURATION_S} s, retry {RETRY_PERIOD_S} s); "
            f"old leader paused {paused_s:.2f} s; {len(outcomes.texts)} completed, "
            f"{len(outcomes.refusals)} refused with Retry-After"
        )
        assert takeover_s < DURATION_S + RENEW_DEADLINE_S + 5
    finally:
        stop.set()
        for gateway in started:
            gateway.process.resume()
            gateway.process.stop()


def _addressed() -> dict[str, str]:
    """A fixed port, and the address the replica writes on the Lease while it coordinates."""
    port = free_port()
    return {"STRATA_LISTEN": f"127.0.0.1:{port}", "STRATA_ADVERTISE_URL": f"http://127.0.0.1:{port}"}


@pytest.mark.cluster
def test_a_standby_serves_completions_through_the_coordinator(
    control_plane: ControlPlane, api_client: client.ApiClient, model: Path, stages: list[RunningStage], tmp_path: Path
) -> None:
    lease = f"forward-{uuid.uuid4().hex[:6]}"
    common = {"model": model, "stages": stages, "plane": control_plane, "lease": lease, "log_dir": tmp_path}
    first = _start_gateway(name="gateway-a", extra_env=_addressed(), **common)  # type: ignore[arg-type]
    started = [first]
    try:
        _wait(first.ready, timeout_s=60, what="the first gateway is elected and ready")
        second = _start_gateway(name="gateway-b", extra_env=_addressed(), **common)  # type: ignore[arg-type]
        started.append(second)
        _wait(second.ready, timeout_s=30, what="the standby knows the coordinator and is ready")
        assert first.url in httpx.get(f"{second.url}/readyz").json()["status"]
        holder = client.CoordinationV1Api(api_client).read_namespaced_lease(name=lease, namespace="default").spec
        assert holder.holder_identity.startswith("gateway-a-"), "the standby still stands by"

        reference = httpx.post(f"{first.url}/v1/completions", json=REQUEST, timeout=60).json()["choices"][0]["text"]
        plain = httpx.post(f"{second.url}/v1/completions", json=REQUEST, timeout=60)
        assert plain.status_code == 200, plain.text
        assert plain.json()["choices"][0]["text"] == reference
        streamed = httpx.post(f"{second.url}/v1/completions", json=REQUEST | {"stream": True}, timeout=60)
        assert streamed.status_code == 200, streamed.text
        events = [line.removeprefix("data: ") for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        texts = [json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"]]
        assert "".join(texts) == reference
    finally:
        for gateway in started:
            gateway.process.stop()


@pytest.mark.cluster
def test_a_gateway_refused_by_a_stage_records_an_event_naming_the_term_and_the_stage(
    control_plane: ControlPlane, api_client: client.ApiClient, model: Path, stages: list[RunningStage], tmp_path: Path
) -> None:
    # Another coordinator already holds term 2 on the last stage: the new gateway's terms 1 and 2 are refused there.
    stages[1].service.fence.admit(Holder(term=2, holder="another-gateway", lease_uid="another-lease"))
    deployment, uid = f"fenced-{uuid.uuid4().hex[:6]}", str(uuid.uuid4())
    gateway = _start_gateway(
        name="gateway-c",
        model=model,
        stages=stages,
        plane=control_plane,
        lease=f"{deployment}-coordinator",
        log_dir=tmp_path,
        extra_env={"STRATA_DEPLOYMENT_NAME": deployment, "STRATA_DEPLOYMENT_UID": uid},
    )
    core = client.CoreV1Api(api_client)

    def fenced() -> list[client.CoreV1Event]:
        selector = f"involvedObject.name={deployment},reason={COORDINATOR_FENCED}"
        return list(core.list_namespaced_event(namespace="default", field_selector=selector).items)

    try:
        _wait(gateway.ready, timeout_s=30, what="the gateway climbs to a term every stage accepts")
        assert [s.service.fence.accepted_term for s in stages] == [3, 3]
        _wait(lambda: len(fenced()) == 2, timeout_s=10, what="an Event for each refused term")
    finally:
        gateway.process.stop()
    events = sorted(fenced(), key=lambda e: e.message)
    for term, event in zip((1, 2), events, strict=True):
        involved = event.involved_object
        assert (involved.api_version, involved.kind, involved.name, involved.uid) == (
            API_VERSION,
            KIND,
            deployment,
            uid,
        )
        assert event.type == "Warning"
        assert event.message.startswith(f"a stage refused coordinator term {term} held by gateway-c-"), event.message
        assert ": stage 1: " in event.message, "the Event names the stage that refused"
