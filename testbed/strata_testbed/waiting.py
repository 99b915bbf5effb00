"""Waiting on a real cluster: poll a probe until it holds, install a CRD until the API server serves it, and hold a
namespace of one's own for a test."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
    """Create `crd`, or replace the one already there (an earlier test may have installed another version of it),
    and wait until the API server reports it Established."""
    ext = client.ApiextensionsV1Api(api_client)
    name = crd["metadata"]["name"]
    try:
        ext.create_custom_resource_definition(body=crd)
    except ApiException as e:
        if e.status != 409:
            raise
        current = ext.read_custom_resource_definition(name=name)
        body = {**crd, "metadata": {**crd["metadata"], "resourceVersion": current.metadata.resource_version}}
        ext.replace_custom_resource_definition(name=name, body=body)
    eventually(
        lambda: any(
            c.type == "Established" and c.status == "True"
            for c in ext.read_custom_resource_definition(name=name).status.conditions or []
        ),
        timeout=30,
        what=f"the CRD {name} to be established",
    )


@contextmanager
def fresh_namespace(api_client: client.ApiClient, prefix: str) -> Iterator[str]:
    """A new namespace named `prefix`-<random>, deleted afterwards."""
    core = client.CoreV1Api(api_client)
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    core.create_namespace(body={"metadata": {"name": name}})
    try:
        yield name
    finally:
        core.delete_namespace(name=name)
