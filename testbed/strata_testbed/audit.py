"""The operator's requests as the API server's audit log records them (the test bed audits only its identity).

The API server's own request metrics do not say who asked; its audit log does. A request is counted once, by the
time the API server received it, however many stages (response started, response complete) it logged.
"""

from __future__ import annotations

import datetime as dt
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Request:
    verb: str  # list, watch, get, patch, create, update, delete
    resource: str  # pods, nodes, modeldeployments/status, ...
    namespace: str | None  # None: a cluster-scope request
    name: str | None
    received: dt.datetime

    @property
    def scope(self) -> str:
        return "cluster" if self.namespace is None else "namespace"


def _when(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


def audited_requests(log: Path, *, since: dt.datetime, until: dt.datetime | None = None) -> list[Request]:
    """Requests received in [since, until) (both aware datetimes), in the order received."""
    seen: dict[str, Request] = {}
    if not log.exists():
        return []
    with log.open() as lines:
        for line in lines:
            event = json.loads(line)
            received = _when(event["requestReceivedTimestamp"])
            if event["auditID"] in seen or received < since or (until is not None and received >= until):
                continue
            ref = event.get("objectRef") or {}
            resource = ref.get("resource", event["requestURI"])
            if ref.get("subresource"):
                resource = f"{resource}/{ref['subresource']}"
            seen[event["auditID"]] = Request(
                verb=event["verb"],
                resource=resource,
                namespace=ref.get("namespace"),
                name=ref.get("name"),
                received=received,
            )
    return sorted(seen.values(), key=lambda r: r.received)


def by_verb_and_resource(requests: list[Request]) -> Counter[tuple[str, str, str]]:
    """(verb, resource, scope) -> count, the table the bench prints."""
    return Counter((r.verb, r.resource, r.scope) for r in requests)
