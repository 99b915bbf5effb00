"""Waiting on a real cluster: poll a probe until it holds, and install a CRD until the API server serves it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from kubernetes import client
from kubernetes.client.exceptions import ApiException

T = TypeVar("T")


def eventually(probe: Callable[[], T | None], *, timeout: float = 90.0, what: str) -> T:
    """The probe's first truthy answer; an AssertionError naming `what` and the last answer after `timeout`."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last: {last!r}")


def establish_crd(api_client: client.ApiClient, crd: dict[str, Any]) -> None:
    """Create `crd` (or find it already there) and wait until the API server reports it Established."""
    ext = client.ApiextensionsV1Api(api_client)
    try:
        ext.create_custom_resource_definition(body=crd)
    except ApiException as e:
        if e.status != 409:
            raise
    name = crd["metadata"]["name"]
    eventually(
        lambda: any(
            c.type == "Established" and c.status == "True"
            for c in ext.read_custom_resource_definition(name=name).status.conditions or []
        ),
        timeout=30,
        what=f"the CRD {name} to be established",
    )
