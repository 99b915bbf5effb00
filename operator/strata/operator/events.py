"""Events about a ModelDeployment, aggregated: one Event per cause whose count grows, as client-go's recorder does.

kopf posts a new Event object each time it is asked, so a model retried every few seconds would fill the namespace
with copies of one message. Here an Event's name is derived from what it says (the object's uid, type, reason and
message): the same cause again finds its Event and bumps `count` and `lastTimestamp` instead. Posting is best effort,
as kopf's is: an Event that cannot be written is logged and never fails a reconcile.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import threading
from collections.abc import Mapping
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

COMPONENT = "strata-operator"
MAX_MESSAGE_CHARS = 1024  # what kopf and kubectl's recorder keep of a message
_NAME_PREFIX_CHARS = 253 - 17  # an object name, a dot and 16 hex digits within the API's 253

logger = logging.getLogger("strata.operator")


def event_name(meta: Mapping[str, Any], *, type: str, reason: str, message: str) -> str:
    digest = hashlib.sha256("\0".join((meta["uid"], type, reason, message)).encode()).hexdigest()[:16]
    return f"{meta['name'][:_NAME_PREFIX_CHARS]}.{digest}"


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class EventRecorder:
    def __init__(self, core: client.CoreV1Api) -> None:
        self._core = core
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}  # Events this process wrote, so a repeat is one patch

    def record(self, body: Mapping[str, Any], *, type: str, reason: str, message: str) -> None:
        meta = body["metadata"]
        message = message[:MAX_MESSAGE_CHARS]
        name = event_name(meta, type=type, reason=reason, message=message)
        try:
            with self._lock:
                self._counts[name] = self._post(body, name=name, type=type, reason=reason, message=message)
        except ApiException as e:
            logger.warning("cannot record the %s Event %s: HTTP %s %s", reason, name, e.status, e.reason)

    def _post(self, body: Mapping[str, Any], *, name: str, type: str, reason: str, message: str) -> int:
        namespace = body["metadata"]["namespace"]
        count = self._counts.get(name)
        if count is None:
            try:
                self._core.create_namespaced_event(
                    namespace=namespace, body=self._new(body, name=name, type=type, reason=reason, message=message)
                )
                return 1
            except ApiException as e:
                if e.status != 409:
                    raise
            # Written before this process started (a restart, another replica): continue its count.
            count = self._core.read_namespaced_event(name=name, namespace=namespace).count or 1
        try:
            self._core.patch_namespaced_event(
                name=name, namespace=namespace, body={"count": count + 1, "lastTimestamp": _now()}
            )
        except ApiException as e:
            if e.status != 404:
                raise
            self._counts.pop(name, None)  # expired (the API server keeps Events for an hour): start a new one
            return self._post(body, name=name, type=type, reason=reason, message=message)
        return count + 1

    @staticmethod
    def _new(body: Mapping[str, Any], *, name: str, type: str, reason: str, message: str) -> dict[str, Any]:
        meta = body["metadata"]
        now = _now()
        return {
            "metadata": {"name": name, "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": body["apiVersion"],
                "kind": body["kind"],
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta["uid"],
            },
            "type": type,
            "reason": reason,
            "message": message,
            "count": 1,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "source": {"component": COMPONENT},
        }
