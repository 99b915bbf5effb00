"""Lease election on the real API server: one holder at a time, and a term that grows with every new holder."""

from __future__ import annotations

import time
import uuid

import pytest
from kubernetes import client
from strata.lease import LeaseElector, LeaseTiming, LeaseView

FAST = LeaseTiming(duration_seconds=3, renew_deadline_seconds=2.0, retry_period_seconds=0.5)


def _pair(api_client: client.ApiClient) -> tuple[LeaseElector, LeaseElector]:
    api = client.CoordinationV1Api(api_client)
    name = f"lease-{uuid.uuid4().hex[:6]}"
    return tuple(  # type: ignore[return-value]
        LeaseElector(api=api, namespace="default", name=name, identity=who, timing=FAST) for who in ("a", "b")
    )


@pytest.mark.cluster
def test_the_first_candidate_takes_term_one_and_the_second_waits(api_client: client.ApiClient) -> None:
    a, b = _pair(api_client)
    token = a.try_acquire_or_renew()
    assert token is not None
    assert (token.term, token.holder) == (1, "a")
    assert b.try_acquire_or_renew() is None
    assert a.try_acquire_or_renew() == token, "renewing keeps the same term"


@pytest.mark.cluster
def test_a_standby_takes_an_expired_lease_with_a_higher_term_and_the_old_holder_stays_out(
    api_client: client.ApiClient,
) -> None:
    a, b = _pair(api_client)
    first = a.try_acquire_or_renew()
    assert first is not None
    time.sleep(FAST.duration_seconds + 0.5)
    second = b.try_acquire_or_renew()
    assert second is not None
    assert second.term == first.term + 1
    assert second.lease_uid == first.lease_uid
    assert a.try_acquire_or_renew() is None


@pytest.mark.cluster
def test_releasing_hands_over_at_once(api_client: client.ApiClient) -> None:
    a, b = _pair(api_client)
    first = a.try_acquire_or_renew()
    assert first is not None
    a.release()
    second = b.try_acquire_or_renew()
    assert second is not None
    assert second.term == first.term + 1


@pytest.mark.cluster
def test_the_holder_writes_its_annotations_with_each_renewal_and_a_standby_reads_them_and_writes_none(
    api_client: client.ApiClient,
) -> None:
    api = client.CoordinationV1Api(api_client)
    name = f"lease-{uuid.uuid4().hex[:6]}"
    a, b = (LeaseElector(api=api, namespace="default", name=name, identity=who, timing=FAST) for who in ("a", "b"))
    a.annotations = {"strata.dev/demand": "first"}
    b.annotations = {"strata.dev/demand": "standby"}
    assert a.try_acquire_or_renew() is not None
    assert b.try_acquire_or_renew() is None
    a.annotations = {"strata.dev/demand": "second"}
    assert a.try_acquire_or_renew() is not None
    lease = api.read_namespaced_lease(name=name, namespace="default")
    assert lease.metadata.annotations == {"strata.dev/demand": "second"}
    assert b.try_acquire_or_renew() is None
    assert b.observed == LeaseView(holder="a", annotations={"strata.dev/demand": "second"}), "what a standby read"


@pytest.mark.parametrize(
    ("retry", "deadline", "duration"),
    [
        pytest.param(2.0, 1.0, 15, id="a renew deadline shorter than the retry period is refused"),
        pytest.param(1.0, 20.0, 15, id="a renew deadline past the lease duration is refused"),
    ],
)
def test_unsafe_timings_are_refused(retry: float, deadline: float, duration: int) -> None:
    with pytest.raises(ValueError, match="lease timing"):
        LeaseTiming(duration_seconds=duration, renew_deadline_seconds=deadline, retry_period_seconds=retry)
