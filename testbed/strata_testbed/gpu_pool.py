"""The fake GPU node pool (testbed/gpu-pool.yaml), created through the real API server and left to kwok."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from strata_testbed.controlplane import KWOK_MANAGED_ANNOTATION

POOL_FILE = Path(__file__).resolve().parent.parent / "gpu-pool.yaml"


def pool_nodes(path: Path = POOL_FILE) -> list[dict[str, Any]]:
    document = yaml.safe_load(path.read_text())
    return [item for item in document["items"] if item["kind"] == "Node"]


def _is_ready(node: client.V1Node) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in (node.status.conditions or []))


def create_gpu_pool(api: client.CoreV1Api, *, timeout: float = 60.0, path: Path = POOL_FILE) -> list[str]:
    """Create every node of the pool; wait until kwok reports the nodes it heartbeats Ready."""
    names = []
    expect_ready = []
    for node in pool_nodes(path):
        name = node["metadata"]["name"]
        created = api.create_node(body=node)
        # A node's status is a subresource: write it separately so conditions such as Ready=False stick.
        api.patch_node_status(name=name, body={"status": node["status"]})
        names.append(created.metadata.name)
        if node["metadata"].get("annotations", {}).get(KWOK_MANAGED_ANNOTATION) == "fake":
            expect_ready.append(name)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(_is_ready(api.read_node(name=n)) for n in expect_ready):
            return names
        time.sleep(0.5)
    raise TimeoutError(f"kwok did not mark the pool nodes Ready within {timeout:.0f} s: {expect_ready}")
