"""kopf wiring: which events reach the reconciler, and how its typed errors map to kopf's retries.

Handlers are idempotent and never sleep. A spec or model that is wrong is not an exception here: the reconciler says
so in the status, and a model that cannot be read yet is read again by the retry timer once its back-off delay has
passed (kopf's own retries would also hold back the next spec change until the delay ends, so a fix would wait
minutes). An API failure is left to kopf's retries; the periodic monitor is a kopf timer rather than a loop inside a
handler. Every status write derives the phase and reason columns from the conditions (strata.operator.conditions),
and Events go through one recorder that aggregates repeats.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf
from strata.operator.conditions import settle
from strata.operator.events import EventRecorder
from strata.operator.planning import placement_problem
from strata.operator.reconcile import Outcome, Reconciler
from strata.operator.spec import GROUP, PLURAL, VERSION, ModelDeploymentSpec
from strata.operator.status import EventReason, ModelDeploymentStatus

MONITOR_INTERVAL_SECONDS = 5.0
RETRY_POLL_SECONDS = 1.0  # how often the retry timer asks whether a back-off delay has passed (no I/O when not)

_state: dict[str, Reconciler] = {}
_events: dict[str, EventRecorder] = {}


def install(reconciler: Reconciler) -> None:
    """Handlers reach the reconciler through here: kopf handlers are module-level functions."""
    _state["reconciler"] = reconciler
    _events["recorder"] = EventRecorder(reconciler.cluster.core)


def _reconciler() -> Reconciler:
    return _state["reconciler"]


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


def _changed_since(body: kopf.Body) -> bool:
    """The object moved on after the timer's copy of it was taken (a spec change handled meanwhile): a status
    computed from that copy would overwrite the newer one with stale conditions, so a timer skips this round."""
    meta = body["metadata"]
    current = _reconciler().cluster.resource_version(
        api_version=body["apiVersion"], kind=body["kind"], namespace=meta["namespace"], name=meta["name"]
    )
    return bool(current != meta.get("resourceVersion"))


def _publish(outcome: Outcome, *, body: Any, patch: kopf.Patch, from_timer: bool = False) -> None:
    if from_timer and _changed_since(body):
        return
    for event in outcome.events:
        logging.getLogger("strata.operator").info("%s %s: %s", event.type, event.reason, event.message)
        _events["recorder"].record(body, type=event.type, reason=str(event.reason), message=event.message)
    settle(outcome.status)
    patch.status.update(outcome.status.model_dump(by_alias=True, mode="json", exclude_none=False))


def _reconcile(
    body: kopf.Body, patch: kopf.Patch, logger: logging.Logger | logging.LoggerAdapter[Any], *, from_timer: bool = False
) -> None:
    outcome = _reconciler().reconcile(dict(body))
    _publish(outcome, body=body, patch=patch, from_timer=from_timer)
    logger.info("reconciled: phase %s (%s)", outcome.status.phase, outcome.status.reason)


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def reconcile_deployment(
    body: kopf.Body, patch: kopf.Patch, logger: logging.Logger | logging.LoggerAdapter[Any], **_: Any
) -> None:
    _reconcile(body, patch, logger)


@kopf.timer(GROUP, VERSION, PLURAL, interval=RETRY_POLL_SECONDS)
def retry_deployment(
    body: kopf.Body, patch: kopf.Patch, logger: logging.Logger | logging.LoggerAdapter[Any], **_: Any
) -> None:
    """Read a model again once its back-off delay has passed: a server back up or a Secret created fixes a
    deployment without a spec change."""
    if _reconciler().backoff.due(body["metadata"]["uid"]):
        _reconcile(body, patch, logger, from_timer=True)


@kopf.timer(GROUP, VERSION, PLURAL, interval=MONITOR_INTERVAL_SECONDS, initial_delay=MONITOR_INTERVAL_SECONDS)
def monitor_deployment(
    body: kopf.Body, patch: kopf.Patch, logger: logging.Logger | logging.LoggerAdapter[Any], **_: Any
) -> None:
    """Readiness into status; a re-plan when the pool no longer holds the current placement (or now fits one)."""
    reconciler = _reconciler()
    status = ModelDeploymentStatus.model_validate(dict(body.get("status") or {}))
    try:
        spec = ModelDeploymentSpec.from_manifest(dict(body["spec"]))
    except ValueError:
        return
    if status.plan is None and status.shortfall is None:
        return
    nodes, pods = reconciler.cluster.pool()
    problem = placement_problem(status=status, nodes=nodes, pods=pods, spec=spec, deployment=body["metadata"])
    if problem is not None:
        if status.plan is not None:
            kopf.warn(body, reason=EventReason.STAGE_LOST.value, message=problem)
        _reconcile(body, patch, logger, from_timer=True)
        return
    meta = body["metadata"]
    outcome = reconciler.advance(dict(body))
    reconciler.observe(
        namespace=meta["namespace"], name=meta["name"], outcome=outcome, generation=int(meta.get("generation", 1))
    )
    reconciler.observe_coordinator(namespace=meta["namespace"], name=meta["name"], outcome=outcome)
    _publish(outcome, body=body, patch=patch, from_timer=True)
