"""Leader election on a coordination.k8s.io/v1 Lease, with a term that only grows.

Written on the plain kubernetes client because the client library's own elector never increments
`leaseTransitions` and keeps running after it loses. Here every change of holder is a resourceVersion-guarded
replace that bumps `leaseTransitions`; that number is the term, and (Lease uid, term) is the fencing token a stage
checks. A holder that cannot renew before `renew_deadline` considers itself deposed, well before the Lease expires
for the others, so two holders never act at once.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError


@dataclass(frozen=True)
class FencingToken:
    lease_uid: str
    term: int
    holder: str


@dataclass(frozen=True)
class LeaseTiming:
    duration_seconds: int = 15
    renew_deadline_seconds: float = 10.0
    retry_period_seconds: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_period_seconds < self.renew_deadline_seconds < self.duration_seconds:
            raise ValueError(
                "lease timing needs 0 < retry period < renew deadline < duration, got "
                f"{self.retry_period_seconds} < {self.renew_deadline_seconds} < {self.duration_seconds}"
            )


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _expired(lease: Any, now: dt.datetime) -> bool:
    spec = lease.spec
    renewed = spec.renew_time or spec.acquire_time
    if not spec.holder_identity or renewed is None or spec.lease_duration_seconds is None:
        return True
    return bool(renewed + dt.timedelta(seconds=spec.lease_duration_seconds) < now)


@dataclass(frozen=True)
class LeaseView:
    """The Lease as a round last read it: who holds it ("" for nobody) and its annotations (the coordinator's
    address among them, strata.gateway.forwarding)."""

    holder: str
    annotations: Mapping[str, str]


class LeaseElector:
    """Call `try_acquire_or_renew()` every retry period; it returns the token while this identity holds the Lease."""

    def __init__(
        self,
        *,
        api: client.CoordinationV1Api,
        namespace: str,
        name: str,
        identity: str,
        timing: LeaseTiming,
    ) -> None:
        self._api = api
        # Written on the Lease with every renewal or takeover by this holder (the gateway's demand, strata.demand):
        # a renewal already writes the whole object, so they cost no request of their own. The caller replaces the
        # mapping between rounds; a round runs in a worker thread and reads only the mapping it finds.
        self.annotations: Mapping[str, str] = {}
        self._namespace = namespace
        self._name = name
        self.identity = identity
        self.timing = timing
        self._last_renewed: dt.datetime | None = None
        self._token: FencingToken | None = None
        # The last Lease read; kept through a failed read, so a blip at the API server changes nothing here.
        self.observed: LeaseView | None = None

    def try_acquire_or_renew(self) -> FencingToken | None:
        now = _now()
        try:
            lease = self._api.read_namespaced_lease(name=self._name, namespace=self._namespace)
        except ApiException as e:
            if e.status != 404:
                return self._still_leading(now)
            self.observed = LeaseView(holder="", annotations={})
            return self._create(now)
        except (HTTPError, OSError):
            return self._still_leading(now)
        spec = lease.spec
        self.observed = LeaseView(holder=spec.holder_identity or "", annotations=dict(lease.metadata.annotations or {}))
        if spec.holder_identity == self.identity:
            spec.renew_time = now
        elif _expired(lease, now):
            spec.holder_identity = self.identity
            spec.acquire_time = now
            spec.renew_time = now
            spec.lease_transitions = (spec.lease_transitions or 0) + 1
        else:
            self._last_renewed = None
            return None
        spec.lease_duration_seconds = self.timing.duration_seconds
        if self.annotations:
            lease.metadata.annotations = {**(lease.metadata.annotations or {}), **self.annotations}
        try:
            # The body carries the resourceVersion we read: a concurrent writer makes this a 409, not a overwrite.
            updated = self._api.replace_namespaced_lease(name=self._name, namespace=self._namespace, body=lease)
        except ApiException as e:
            if e.status == 409:
                self._last_renewed = None
                return None
            return self._still_leading(now)
        except (HTTPError, OSError):
            return self._still_leading(now)
        return self._held(now, updated)

    def release(self) -> None:
        """Give the Lease up at shutdown so a standby takes over at once instead of waiting for expiry."""
        try:
            lease = self._api.read_namespaced_lease(name=self._name, namespace=self._namespace)
            if lease.spec.holder_identity != self.identity:
                return
            lease.spec.holder_identity = None
            lease.spec.renew_time = None
            self._api.replace_namespaced_lease(name=self._name, namespace=self._namespace, body=lease)
        except (ApiException, HTTPError, OSError):
            return
        finally:
            self._last_renewed = None

    def _create(self, now: dt.datetime) -> FencingToken | None:
        body = {
            "metadata": {"name": self._name},
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": self.timing.duration_seconds,
                "acquireTime": now.isoformat(),
                "renewTime": now.isoformat(),
                "leaseTransitions": 1,
            },
        }
        try:
            created = self._api.create_namespaced_lease(namespace=self._namespace, body=body)
        except (ApiException, HTTPError, OSError):
            return None
        return self._held(now, created)

    def _held(self, now: dt.datetime, lease: Any) -> FencingToken:
        self._last_renewed = now
        self._token = FencingToken(
            lease_uid=lease.metadata.uid, term=lease.spec.lease_transitions, holder=self.identity
        )
        return self._token

    def _still_leading(self, now: dt.datetime) -> FencingToken | None:
        """An API error while holding: keep leading only until the renew deadline passes."""
        if self._last_renewed is None:
            return None
        if now - self._last_renewed > dt.timedelta(seconds=self.timing.renew_deadline_seconds):
            self._last_renewed = None
            return None
        return self._token
