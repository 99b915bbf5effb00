"""kopf wiring: which events reach the reconciler, and when each deployment's monitor looks again.

Handlers are idempotent and never sleep. A spec or model that is wrong is not an exception here: the reconciler says
so in the status, and a model that cannot be read yet is read again by the deployment's monitor once its back-off
delay has passed (kopf's own retries would also hold back the next spec change until the delay ends, so a fix would
wait minutes). An API failure is left to kopf's retries in a handler, and to the next pass in the monitor.

Each deployment's monitor is a kopf daemon that waits on its doorbell: the watches ring it when a node it is placed
on changes, a foreign pod takes GPUs there, or one of its children moves, and it looks at once (after a short
debounce so a burst of events is one look). Without a ring it looks every few seconds while a generation loads or
retires, when a model's back-off delay ends, and only as a slow safety net once everything is steady; every look
reads the watch-fed cache, so a quiet deployment costs the API server nothing. Every status write derives the phase
and reason columns from the conditions (strata.operator.conditions) and goes through the StatusWriter, which sends
only what changed; Events go through one recorder that aggregates repeats.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException
from strata.operator.autoscaler import autoscale
from strata.operator.children import Owner
from strata.operator.conditions import settle
from strata.operator.doorbells import DeploymentKey, Doorbells
from strata.operator.events import EventRecorder
from strata.operator.outcome import Event, Outcome
from strata.operator.planning import placement_problem
from strata.operator.reconcile import Reconciler
from strata.operator.replicas import rollout_waits
from strata.operator.spec import GROUP, PLURAL, VERSION, ModelDeploymentSpec
from strata.operator.status import EventReason, ModelDeploymentStatus, Phase
from strata.operator.status_writer import StatusWriter, plain

SETTLING_SECONDS = 5.0  # while a generation loads: its stages' load progress is asked this often
SAFETY_NET_SECONDS = 60.0  # a steady deployment looks this often even when no watch rang
# An autoscaled deployment looks this often too: its delays run out without any watch ringing. A change in the
# gateway's demand rings at once (the coordinator Lease's annotation is in the watch's projection).
AUTOSCALE_SECONDS = 5.0
DEBOUNCE_SECONDS = 0.2
# Nothing more happens on its own in these phases once the newest generation serves (or none can be applied).
_STEADY_PHASES = (Phase.READY, Phase.FAILED, Phase.CHANGE_REFUSED, Phase.SCALED_TO_ZERO)


@dataclass(frozen=True)
class _Installed:
    reconciler: Reconciler
    writer: StatusWriter
    doorbells: Doorbells
    events: EventRecorder


_state: dict[str, _Installed] = {}


def install(reconciler: Reconciler, *, writer: StatusWriter, doorbells: Doorbells) -> None:
    """Handlers reach the reconciler through here: kopf handlers are module-level functions."""
    _state["installed"] = _Installed(
        reconciler=reconciler, writer=writer, doorbells=doorbells, events=EventRecorder(reconciler.cluster.core)
    )


def _installed() -> _Installed:
    return _state["installed"]


def _reconciler() -> Reconciler:
    return _installed().reconciler


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    """kopf connects with the same credentials as the reconciler's client, in-cluster or from --kubeconfig."""
    configuration = _reconciler().cluster.configuration
    # The client keeps the token as "Bearer ..." (kubeconfig) or "bearer ..." (in-cluster) under "BearerToken"; the
    # getter also runs the in-cluster refresh hook, so a rotated ServiceAccount token is picked up on re-login.
    authorization = configuration.get_api_key_with_prefix("BearerToken", alias="authorization") or ""
    scheme, _space, credential = authorization.partition(" ")
    token = (credential if scheme.lower() == "bearer" else authorization).strip() or None
    return kopf.ConnectionInfo(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
        token=token,
        scheme="Bearer" if token else None,
    )


def _key(body: Mapping[str, Any]) -> DeploymentKey:
    return str(body["metadata"]["namespace"]), str(body["metadata"]["name"])


def placed_nodes(status: Mapping[str, Any] | None) -> set[str] | None:
    """Nodes that the newest and the serving generation of every pipeline use; None while there is no placement to
    lose."""
    status = status or {}
    pipelines = status.get("pipelines") or ()
    plans = [p for p in (status.get("plan"), status.get("serving")) if p]
    plans += [plan for pipeline in pipelines for plan in (pipeline.get("plan"), pipeline.get("serving")) if plan]
    if not plans:
        return None
    return {stage["node"] for plan in plans for stage in plan.get("stages") or ()}


def _record(body: Mapping[str, Any], *, type: str, reason: str, message: str) -> None:
    logging.getLogger("strata.operator").info("%s %s: %s", type, reason, message)
    _installed().events.record(body, type=type, reason=reason, message=message)


def _publish(outcome: Outcome, *, key: DeploymentKey, body: Mapping[str, Any]) -> None:
    installed = _installed()
    for event in outcome.events:
        _record(body, type=event.type, reason=str(event.reason), message=event.message)
    settle(outcome.status)
    status = outcome.status.model_dump(by_alias=True, mode="json", exclude_none=False)
    installed.writer.write(key, based_on=body, status=status)
    installed.doorbells.place(key, placed_nodes(status))


def _reconcile(
    body: dict[str, Any], *, key: DeploymentKey, logger: logging.Logger | logging.LoggerAdapter[Any]
) -> Outcome:
    outcome = _reconciler().reconcile(body)
    _publish(outcome, key=key, body=body)
    logger.info("reconciled: phase %s (%s)", outcome.status.phase, outcome.status.reason)
    return outcome


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def reconcile_deployment(body: kopf.Body, logger: logging.Logger | logging.LoggerAdapter[Any], **_: Any) -> None:
    key = _key(body)
    installed = _installed()
    with installed.writer.lock(key):
        outcome = _reconcile(installed.writer.freshest(key, body), key=key, logger=logger)
    if outcome.retry_in is not None or outcome.status.retiring:
        # The monitor may be asleep for a minute: it must wait for the back-off, or delete a retiring generation's
        # stages once the gateway's drain bound has passed.
        installed.doorbells.ring({key})


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=30.0)
async def monitor_deployment(
    stopped: kopf.DaemonStopped, body: kopf.Body, logger: logging.Logger | logging.LoggerAdapter[Any], **_: Any
) -> None:
    """Readiness into status; a re-plan when the pool no longer holds the current placement (or now fits one); the
    model read again once its back-off delay has passed.

    `body` is kopf's live view of the object; the pass itself runs in a thread, as the reconciler blocks."""
    key = _key(body)
    uid = str(body["metadata"]["uid"])
    installed = _installed()
    backoff = installed.reconciler.backoff
    bell = installed.doorbells.register(key)
    installed.doorbells.place(key, placed_nodes(plain(body.get("status"))))
    loop = asyncio.get_running_loop()
    last_look = loop.time()
    wait = SETTLING_SECONDS
    try:
        while not stopped:
            retry = backoff.remaining(uid)
            rang = await _rung(bell, stopped, seconds=wait if retry is None else min(wait, retry))
            if stopped:
                return
            if rang:
                await asyncio.sleep(DEBOUNCE_SECONDS)
            bell.clear()
            look = rang or loop.time() - last_look >= SAFETY_NET_SECONDS
            if look:
                last_look = loop.time()
            steady = await asyncio.to_thread(_monitor_pass, key, body, logger, look)
            wait = SAFETY_NET_SECONDS if steady else SETTLING_SECONDS
            if (body.get("spec") or {}).get("autoscaling") is not None:
                wait = min(wait, AUTOSCALE_SECONDS)
    finally:
        installed.doorbells.unregister(key)
        installed.writer.forget(key)


async def _rung(bell: asyncio.Event, stopped: kopf.DaemonStopped, *, seconds: float) -> bool:
    async def stopping() -> None:
        await stopped.wait()

    rung, stop = asyncio.ensure_future(bell.wait()), asyncio.ensure_future(stopping())
    done, pending = await asyncio.wait({rung, stop}, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    return rung in done


def _monitor_pass(
    key: DeploymentKey, live: kopf.Body, logger: logging.Logger | logging.LoggerAdapter[Any], look: bool
) -> bool:
    """One look at a deployment; True when it is steady (nothing loading, nothing to cut over, no retry waiting).

    The writer's lock and freshest copy keep a pass from computing over a status that a handler has just written."""
    installed = _installed()
    with installed.writer.lock(key):
        body = installed.writer.freshest(key, live)
        try:
            if installed.reconciler.backoff.due(str(body["metadata"]["uid"])):
                _reconcile(body, key=key, logger=logger)
                return False
            return _observe(body, key=key, logger=logger, look=look)
        except ApiException as e:
            logger.warning("monitor of %s/%s: HTTP %s %s; looking again shortly", key[0], key[1], e.status, e.reason)
            return False


def _observe(
    body: dict[str, Any], *, key: DeploymentKey, logger: logging.Logger | logging.LoggerAdapter[Any], look: bool
) -> bool:
    reconciler = _reconciler()
    status = ModelDeploymentStatus.model_validate(body.get("status") or {})
    try:
        spec = ModelDeploymentSpec.from_manifest(body["spec"])
    except ValueError:
        return True  # the handler said why in the status; only a spec change helps
    if status.plan is None and status.shortfall is None:
        return True
    if look:
        nodes, pods = reconciler.cluster.pool()
        problem = placement_problem(status=status, nodes=nodes, pods=pods, spec=spec, deployment=body["metadata"])
        if problem is not None:
            if status.plan is not None:
                _record(body, type="Warning", reason=EventReason.STAGE_LOST.value, message=problem)
            _reconcile(body, key=key, logger=logger)
            return False
    if status.plan is None:
        return True  # a shortfall: only a change to the pool (or the safety net) makes it look again
    meta = body["metadata"]
    if rollout_waits(status.pipelines, spec_generation=int(meta.get("generation", 1))):
        _reconcile(body, key=key, logger=logger)
        return False
    outcome = reconciler.advance(body)
    owner = Owner(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])
    reconciler.observe(owner, outcome=outcome, generation=int(meta.get("generation", 1)), replicas=spec.replicas)
    reconciler.observe_coordinator(namespace=meta["namespace"], name=meta["name"], outcome=outcome)
    if spec.autoscaling is not None:
        applied = autoscale(
            reconciler.cluster,
            namespace=meta["namespace"],
            name=meta["name"],
            autoscaling=spec.autoscaling,
            replicas=spec.replicas,
            status=outcome.status,
            now=time.time(),
        )
        if applied.scaled_from is not None:
            said = f"{applied.scaled_from} -> {applied.decision.replicas} pipeline(s): {applied.decision.message}"
            outcome.events.append(Event("Normal", EventReason.SCALED, said))
    else:
        outcome.status.autoscaling = None
    _publish(outcome, key=key, body=body)
    settled = outcome.status
    return bool(
        settled.phase in _STEADY_PHASES
        and not settled.retiring
        and settled.serving is not None
        and settled.plan is not None
        and settled.serving.generation == settled.plan.generation
    )
