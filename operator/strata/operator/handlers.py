"""kopf wiring: which events reach the reconciler, and how its typed errors map to kopf's retries.

Handlers are idempotent and never sleep: a temporary failure (model server down, API conflict) is a
kopf.TemporaryError with a back-off and an invalid spec is a kopf.PermanentError. Each deployment's monitor is a
kopf daemon that waits on its doorbell: the watches ring it when a node it is placed on changes, a foreign pod takes
GPUs there, or one of its children moves, and it looks at once (after a short debounce so a burst of events is one
look). Without a ring it looks every few seconds while a generation loads and only as a slow safety net once
everything is steady; every look reads the watch-fed cache, so a quiet deployment costs the API server nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import kopf
from strata.operator.doorbells import DeploymentKey, Doorbells
from strata.operator.models import ModelUnreadable
from strata.operator.planning import placement_problem
from strata.operator.reconcile import InvalidSpec, Outcome, Reconciler
from strata.operator.spec import GROUP, PLURAL, VERSION, ModelDeploymentSpec
from strata.operator.status import EventReason, ModelDeploymentStatus, Phase
from strata.operator.status_writer import StatusWriter, plain

SETTLING_SECONDS = 5.0  # while a generation loads: its stages' load progress is asked this often
SAFETY_NET_SECONDS = 60.0  # a steady deployment looks this often even when no watch rang
DEBOUNCE_SECONDS = 0.2
RETRY_BACKOFF_SECONDS = 10.0


@dataclass(frozen=True)
class _Installed:
    reconciler: Reconciler
    writer: StatusWriter
    doorbells: Doorbells


_state: dict[str, _Installed] = {}


def install(reconciler: Reconciler, *, writer: StatusWriter, doorbells: Doorbells) -> None:
    """Handlers reach the reconciler through here: kopf handlers are module-level functions."""
    _state["installed"] = _Installed(reconciler=reconciler, writer=writer, doorbells=doorbells)


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


def _target(body: Mapping[str, Any]) -> kopf.Body:
    """The object an Event is about, as kopf's event poster takes it."""
    return kopf.Body(cast(kopf.RawBody, dict(body)))


def placed_nodes(status: Mapping[str, Any] | None) -> set[str] | None:
    """Nodes that the newest and the serving generation use; None while there is no placement to lose."""
    status = status or {}
    plans = [p for p in (status.get("plan"), status.get("serving")) if p]
    if not plans:
        return None
    return {stage["node"] for plan in plans for stage in plan.get("stages") or ()}


def _publish(outcome: Outcome, *, key: DeploymentKey, body: Mapping[str, Any]) -> None:
    installed = _installed()
    for event in outcome.events:
        logging.getLogger("strata.operator").info("%s %s: %s", event.type, event.reason.value, event.message)
        if event.type == "Warning":
            kopf.warn(_target(body), reason=event.reason.value, message=event.message)
        else:
            kopf.info(_target(body), reason=event.reason.value, message=event.message)
    status = outcome.status.model_dump(by_alias=True, mode="json", exclude_none=False)
    installed.writer.write(key, based_on=body, status=status)
    installed.doorbells.place(key, placed_nodes(status))


def _reconcile(
    body: dict[str, Any], *, key: DeploymentKey, logger: logging.Logger | logging.LoggerAdapter[Any]
) -> None:
    try:
        outcome = _reconciler().reconcile(body)
    except InvalidSpec as e:
        kopf.warn(_target(body), reason=EventReason.INVALID_SPEC.value, message=str(e))
        raise kopf.PermanentError(f"invalid spec: {e}") from e
    except ModelUnreadable as e:
        kopf.warn(_target(body), reason=EventReason.MODEL_UNREADABLE.value, message=str(e))
        raise kopf.TemporaryError(str(e), delay=RETRY_BACKOFF_SECONDS) from e
    _publish(outcome, key=key, body=body)
    logger.info("reconciled: phase %s", outcome.status.phase)


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def reconcile_deployment(body: kopf.Body, logger: logging.Logger | logging.LoggerAdapter[Any], **_: Any) -> None:
    key = _key(body)
    writer = _installed().writer
    with writer.lock(key):
        _reconcile(writer.freshest(key, body), key=key, logger=logger)


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=30.0)
async def monitor_deployment(
    stopped: kopf.DaemonStopped, body: kopf.Body, logger: logging.Logger | logging.LoggerAdapter[Any], **_: Any
) -> None:
    """Readiness into status; a re-plan when the pool no longer holds the current placement (or now fits one).

    `body` is kopf's live view of the object; the pass itself runs in a thread, as the reconciler blocks."""
    key = _key(body)
    installed = _installed()
    bell = installed.doorbells.register(key)
    installed.doorbells.place(key, placed_nodes(plain(body.get("status"))))
    loop = asyncio.get_running_loop()
    last_look = loop.time()
    wait = SETTLING_SECONDS
    try:
        while not stopped:
            rang = await _rung(bell, stopped, seconds=wait)
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
    """One look at a deployment; True when it is steady (nothing loading, nothing to cut over)."""
    installed = _installed()
    with installed.writer.lock(key):
        body = installed.writer.freshest(key, live)
        try:
            return _observe(body, key=key, logger=logger, look=look)
        except (kopf.PermanentError, kopf.TemporaryError) as e:
            logger.warning("monitor of %s/%s: %s", key[0], key[1], e)
            return False


def _observe(
    body: dict[str, Any], *, key: DeploymentKey, logger: logging.Logger | logging.LoggerAdapter[Any], look: bool
) -> bool:
    reconciler = _reconciler()
    status = ModelDeploymentStatus.model_validate(body.get("status") or {})
    try:
        spec = ModelDeploymentSpec.from_manifest(body["spec"])
    except ValueError:
        return True
    if status.plan is None and status.shortfall is None:
        return True
    if look:
        nodes, pods = reconciler.cluster.pool()
        problem = placement_problem(status=status, nodes=nodes, pods=pods, spec=spec, deployment=body["metadata"])
        if problem is not None:
            if status.plan is not None:
                kopf.warn(_target(body), reason=EventReason.STAGE_LOST.value, message=problem)
            _reconcile(body, key=key, logger=logger)
            return False
    if status.plan is None:
        return True  # a shortfall: only a change to the pool (or the safety net) makes it look again
    meta = body["metadata"]
    outcome = reconciler.advance(body)
    reconciler.observe(
        namespace=meta["namespace"], name=meta["name"], outcome=outcome, generation=int(meta.get("generation", 1))
    )
    reconciler.observe_coordinator(namespace=meta["namespace"], name=meta["name"], outcome=outcome)
    _publish(outcome, key=key, body=body)
    settled = outcome.status
    return bool(
        settled.phase in (Phase.READY, Phase.FAILED)
        and settled.serving is not None
        and settled.plan is not None
        and settled.serving.generation == settled.plan.generation
    )
