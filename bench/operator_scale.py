"""Benchmark: the operator on the test bed's real control plane, with kwok simulating a large GPU pool.

Run: PYTHONPATH=core:operator:stage_worker:gateway:testbed:bench .venv/bin/python bench/operator_scale.py
     [--nodes 1000] [--other-pods 10000] [--deployments 10 50] [--quiet-seconds 300]

kwok simulates `--nodes` GPU nodes of 8 GPUs (the six kinds of bench/plan_1000_nodes.py: NVIDIA, AMD and Intel,
24 to 192 GB) and runs `--other-pods` pods bound to them, one in ten holding 2 GPUs. The operator (`strata operator`,
its own process and identity) serves ModelDeployments of Llama-3-8B- and 70B-shaped headers from the test bed's HTTP
range server; kwok runs their stage and gateway pods. For each deployment count it measures the time from the first
apply to the last `Planned`, then a quiet window: the operator's requests by verb and resource (the API server's
audit log, which names the caller) and the cluster-scope Node and Pod LISTs of every client
(`apiserver_request_total`). At the end a node that hosts a stage goes NotReady and the time to the re-plan is
taken, and the operator's resident memory is read from /proc.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import re
import ssl
import tempfile
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kubernetes import client, config
from plan_1000_nodes import GPUS_PER_NODE, KINDS, _cpu_name
from strata.gguf.testmodels.writer import write_header_only_model
from strata.operator.crd import render_crd
from strata_testbed.audit import audited_requests, by_verb_and_resource
from strata_testbed.cluster_objects import gpu_node, gpu_pod
from strata_testbed.controlplane import KWOK_MANAGED_ANNOTATION, ControlPlane
from strata_testbed.operator_run import OperatorProcess, condition, create, deployment, read
from strata_testbed.range_server import serve_directory
from strata_testbed.waiting import establish_crd, eventually

NAMESPACE = "bench"
OTHERS = "bench-other"
WRITERS = 8


def _parallel(work: Callable[[int], Any], count: int) -> None:
    with ThreadPoolExecutor(WRITERS) as pool:
        list(pool.map(work, range(count)))


def create_pool(core: client.CoreV1Api, *, nodes: int, other_pods: int) -> list[str]:
    names = [f"{KINDS[i % len(KINDS)][0]}-{i:04d}" for i in range(nodes)]

    def make_node(i: int) -> None:
        prefix, gib, resource = KINDS[i % len(KINDS)]
        body = gpu_node(names[i], gpus=GPUS_PER_NODE, gib=gib, resource=resource, labels={"pool": prefix})
        body["metadata"]["annotations"] = {KWOK_MANAGED_ANNOTATION: "fake"}
        core.create_node(body=body)
        core.patch_node_status(name=names[i], body={"status": body["status"]})

    def make_pod(i: int) -> None:
        node = i % nodes
        gpus = 2 if i % 10 == 0 else 0
        body = gpu_pod(
            f"other-{i:05d}",
            node=names[node],
            gpus=gpus,
            resource=KINDS[node % len(KINDS)][2],
            namespace=OTHERS,
            via="limits",  # the API server wants a limit for an extended resource; the request follows it
        )
        body["spec"]["containers"][0]["image"] = "busybox"
        if not gpus:
            body["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "10m"}}
        core.create_namespaced_pod(namespace=OTHERS, body=body)

    _parallel(make_node, nodes)
    core.create_namespace(body={"metadata": {"name": OTHERS}})
    eventually(
        lambda: core.list_namespaced_service_account(namespace=OTHERS).items, timeout=60, what="the default account"
    )
    _parallel(make_pod, other_pods)
    return names


def _planned(api: client.ApiClient, name: str) -> bool:
    return (condition(read(api, NAMESPACE, name), "Planned") or {}).get("status") == "True"


def _phase(api: client.ApiClient, name: str) -> str:
    return str((read(api, NAMESPACE, name).get("status") or {}).get("phase"))


def list_counts(plane: ControlPlane) -> dict[tuple[str, str], float]:
    """apiserver_request_total for cluster-scope LISTs of nodes and pods, summed over every client and code."""
    tls = ssl.create_default_context(cafile=str(plane.pki.ca.cert))
    tls.load_cert_chain(str(plane.pki.admin.cert), str(plane.pki.admin.key))
    with urllib.request.urlopen(f"{plane.server}/metrics", context=tls, timeout=30) as response:  # noqa: S310
        text = response.read().decode()
    counts: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
        if (
            labels.get("verb") == "LIST"
            and labels.get("scope") == "cluster"
            and labels.get("resource") in ("nodes", "pods")
        ):
            key = ("LIST", labels["resource"])
            counts[key] = counts.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _set_not_ready(core: client.CoreV1Api, node: str) -> None:
    """kwok turns a node it manages Ready again at once: the node leaves its hands first, as a dead kubelet's."""
    core.patch_node(name=node, body={"metadata": {"annotations": {KWOK_MANAGED_ANNOTATION: "stopped"}}})
    condition = {"type": "Ready", "status": "False", "reason": "KubeletNotReady", "message": "bench stopped it"}
    core.patch_node_status(name=node, body={"status": {"conditions": [condition]}})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--other-pods", type=int, default=10000)
    parser.add_argument("--deployments", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--quiet-seconds", type=float, default=300.0)
    args = parser.parse_args()
    rows: list[tuple[str, str]] = []
    folder = Path(tempfile.mkdtemp(prefix="strata-operator-scale-"))
    models = [
        write_header_only_model(folder / f"{shape}.gguf", shape=shape).path for shape in ("llama3-8b", "llama3-70b")
    ]
    with ControlPlane(work_dir=folder / "cluster") as plane, serve_directory(folder) as server:
        api = config.new_client_from_config(config_file=str(plane.kubeconfig))
        core = client.CoreV1Api(api)
        establish_crd(api, render_crd())
        started = time.monotonic()
        create_pool(core, nodes=args.nodes, other_pods=args.other_pods)
        rows.append(("pool created (nodes, other pods)", f"{time.monotonic() - started:.0f} s"))
        core.create_namespace(body={"metadata": {"name": NAMESPACE}})
        operator = OperatorProcess(plane.operator_kubeconfig, NAMESPACE, folder / "operator.log")
        operator.start()
        assert operator.proc is not None
        applied = 0
        try:
            for total in args.deployments:
                first = time.monotonic()
                names = [f"model-{i:03d}" for i in range(applied, total)]
                for i, name in enumerate(names):
                    url = f"{server.url}/{models[i % 2].name}"
                    body = deployment(name, models[i % 2], context=2048 * (1 + i % 4))
                    body["spec"]["model"]["url"] = url  # served over HTTP ranges, as a model store would
                    create(api, NAMESPACE, body)
                last_apply = time.monotonic()
                applied = total
                every = [f"model-{i:03d}" for i in range(total)]
                eventually(
                    lambda every=every: all(_planned(api, n) for n in every), timeout=300, what=f"{total} Planned"
                )
                planned = time.monotonic()
                rows.append((f"{total} deployments: first apply to last Planned", f"{planned - first:.1f} s"))
                rows.append((f"{total} deployments: last apply to last Planned", f"{planned - last_apply:.1f} s"))
                eventually(
                    lambda every=every: all(_phase(api, n) == "Ready" for n in every), timeout=300, what="all Ready"
                )
                window, lists_before = dt.datetime.now(dt.UTC), list_counts(plane)
                time.sleep(args.quiet_seconds)
                until, lists_after = dt.datetime.now(dt.UTC), list_counts(plane)
                quiet = audited_requests(plane.audit_log, since=window, until=until)
                table = by_verb_and_resource(quiet)
                rate = len(quiet) / args.quiet_seconds
                rows.append(
                    (f"{total} deployments: operator requests in {args.quiet_seconds:.0f} s quiet", str(len(quiet)))
                )
                rows.append((f"{total} deployments: operator request rate", f"{rate:.2f} /s"))
                for (verb, resource, scope), count in sorted(table.items()):
                    rows.append((f"    {verb} {resource} ({scope})", str(count)))
                for key in (("LIST", "nodes"), ("LIST", "pods")):
                    delta = lists_after.get(key, 0) - lists_before.get(key, 0)
                    rows.append((f"    cluster-scope {key[0]} {key[1]}, all clients", f"{delta:.0f}"))
                rows.append((f"{total} deployments: operator RSS", f"{rss_mib(operator.proc.pid):.0f} MiB"))

            victim = "model-000"
            plan = read(api, NAMESPACE, victim)["status"]["plan"]
            node = plan["stages"][0]["node"]
            lost = time.monotonic()
            _set_not_ready(core, node)

            def replanned() -> bool:
                return bool(read(api, NAMESPACE, victim)["status"]["plan"]["generation"] > plan["generation"])

            eventually(replanned, timeout=120, what="the re-plan")
            rows.append(("planned node NotReady -> new plan in status", f"{time.monotonic() - lost:.2f} s"))

            def events() -> set[str]:
                found = {
                    e.reason
                    for e in core.list_namespaced_event(namespace=NAMESPACE).items
                    if e.involved_object.name == victim
                }
                return found if {"StageLost", "Replanned"} <= found else set()

            eventually(events, timeout=60, what="StageLost and Replanned Events")
            rows.append(("  ... -> StageLost and Replanned Events listed", f"{time.monotonic() - lost:.2f} s"))
            rows.append(("operator RSS at the end", f"{rss_mib(operator.proc.pid):.0f} MiB"))
        finally:
            operator.stop()
            api.close()
    print(f"machine: {_cpu_name()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print(f"pool: {args.nodes} kwok nodes x {GPUS_PER_NODE} GPUs, {args.other_pods} other pods (1 in 10 holds 2 GPUs)")
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"{label:<{width}}  {value:>10}")


if __name__ == "__main__":
    main()
