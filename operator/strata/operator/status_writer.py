"""Status writes that happen only when the content changes, and the freshest status to compute them from.

Two paths write a deployment's status: the kopf handlers (create, spec change, resume) and its monitor. Both send
only the top-level fields whose value differs from what the object holds, and nothing at all when none does, so a
quiet deployment costs the API server no writes. The object kopf hands a handler is what the last watch event said;
right after a write that event has not arrived yet, so the writer remembers the object its own PATCH returned and
uses it until the watch catches up (the event's resourceVersion is no longer one the writer has superseded).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from strata.operator.doorbells import DeploymentKey

Manifest = dict[str, Any]


class StatusPatcher(Protocol):
    def patch_status(self, *, namespace: str, name: str, status: Manifest) -> Manifest: ...


def plain(value: Any) -> Any:
    """kopf's body views as plain dicts and lists, so they compare with (and validate like) JSON."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def status_changes(current: Mapping[str, Any] | None, new: Mapping[str, Any]) -> Manifest:
    """The top-level status fields whose value `new` changes; a field absent before and None now is no change."""
    before = current or {}
    return {key: value for key, value in new.items() if before.get(key) != value}


@dataclass
class _Written:
    latest: Manifest
    superseded: set[str] = field(default_factory=set)


class StatusWriter:
    def __init__(self, patcher: StatusPatcher) -> None:
        self._patcher = patcher
        self._guard = threading.Lock()
        self._locks: dict[DeploymentKey, threading.Lock] = {}
        self._written: dict[DeploymentKey, _Written] = {}
        self.writes = 0

    def lock(self, key: DeploymentKey) -> threading.Lock:
        """Held around one reconcile or one monitor pass, so the two never compute from the same old status."""
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())

    def freshest(self, key: DeploymentKey, body: Mapping[str, Any]) -> Manifest:
        seen: Manifest = plain(body)
        with self._guard:
            written = self._written.get(key)
            if written is None:
                return seen
            if (seen.get("metadata") or {}).get("resourceVersion") in written.superseded:
                return written.latest
            del self._written[key]  # the watch has caught up with our last write
            return seen

    def write(self, key: DeploymentKey, *, based_on: Mapping[str, Any], status: Manifest) -> bool:
        """Patch the fields of `status` that differ from `based_on`'s; True when anything was sent."""
        changes = status_changes(based_on.get("status"), status)
        if not changes:
            return False
        namespace, name = key
        response = self._patcher.patch_status(namespace=namespace, name=name, status=changes)
        self.writes += 1
        version = (based_on.get("metadata") or {}).get("resourceVersion")
        with self._guard:
            written = self._written.setdefault(key, _Written(latest=response))
            written.latest = response
            if version:
                written.superseded.add(str(version))
        return True

    def forget(self, key: DeploymentKey) -> None:
        with self._guard:
            self._written.pop(key, None)
            self._locks.pop(key, None)
