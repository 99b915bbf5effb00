"""Kubernetes Events the gateway records on its ModelDeployment: a stage refusing the coordinator's term.

The operator watches Leases and pods, not the calls between the gateway and the stages. When a stage refuses this
gateway's term (FAILED_PRECONDITION: a newer coordinator claimed it, or the call is for another plan generation),
only the gateway knows; a person running `kubectl describe modeldeployment` should see it beside the operator's
Events. Recording is best effort: one worker thread makes the blocking API call with a timeout, and a failure is
logged, never raised, so the serving path neither waits for the API server nor breaks when it refuses.
"""

from __future__ import annotations

import datetime as dt
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from strata.lease import FencingToken
from strata.modeldeployment import API_VERSION, COORDINATOR_FENCED, KIND
from urllib3.exceptions import HTTPError

log = logging.getLogger(__name__)

COMPONENT = "strata-gateway"
REQUEST_TIMEOUT_S = 5.0
# The API server refuses longer Event messages; a stage's refusal is far shorter, but it quotes holder names.
MAX_MESSAGE = 1024


@dataclass(frozen=True, kw_only=True)
class DeploymentRef:
    """The ModelDeployment the Events are about; the uid lets `kubectl describe` find them."""

    namespace: str
    name: str
    uid: str = ""


class EventRecorder:
    def __init__(
        self,
        *,
        api: client.CoreV1Api,
        deployment: DeploymentRef,
        reporter: str,
        timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        self._api = api
        self.deployment = deployment
        self.reporter = reporter  # the pod that saw it
        self.timeout_s = timeout_s
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="events")

    def fenced(self, fence: FencingToken, details: str) -> None:
        """A stage refused `fence`; `details` is its answer, which names the stage."""
        message = f"a stage refused coordinator term {fence.term} held by {fence.holder}: {details}"
        self.warn(reason=COORDINATOR_FENCED, message=message)

    def warn(self, *, reason: str, message: str) -> None:
        """Record a Warning in the background; returns at once."""
        try:
            self._worker.submit(self._post, self._event(reason=reason, message=message))
        except RuntimeError:  # closed: the gateway is shutting down
            log.info("not recording Event %s (shutting down): %s", reason, message)

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    def _event(self, *, reason: str, message: str) -> dict[str, Any]:
        ref = self.deployment
        now = dt.datetime.now(dt.UTC).isoformat()
        involved = {"apiVersion": API_VERSION, "kind": KIND, "namespace": ref.namespace, "name": ref.name}
        return {
            "metadata": {"generateName": f"{ref.name}."},
            "involvedObject": involved | ({"uid": ref.uid} if ref.uid else {}),
            "type": "Warning",
            "reason": reason,
            "message": message[:MAX_MESSAGE],
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "reportingInstance": self.reporter[:128],  # the API server's limit
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }

    def _post(self, event: dict[str, Any]) -> None:
        ref = self.deployment
        try:
            self._api.create_namespaced_event(namespace=ref.namespace, body=event, _request_timeout=self.timeout_s)
        except (ApiException, HTTPError, OSError, ValueError) as error:
            log.warning(
                "could not record Event %s on %s %s/%s: %s", event["reason"], KIND, ref.namespace, ref.name, error
            )
            return
        log.info("recorded Event %s on %s %s/%s: %s", event["reason"], KIND, ref.namespace, ref.name, event["message"])


def deployment_recorder(*, namespace: str, name: str, uid: str, reporter: str) -> EventRecorder:
    """A recorder on ModelDeployment `namespace/name`, with the gateway's own credentials (see kube_client)."""
    from strata.gateway.coordination import kube_client

    ref = DeploymentRef(namespace=namespace, name=name, uid=uid)
    return EventRecorder(api=client.CoreV1Api(kube_client()), deployment=ref, reporter=reporter)
