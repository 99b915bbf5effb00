"""Benchmark: plan a 70B model on 1,000 nodes of 8 mixed GPUs (inventory from Node/Pod dicts plus the search).

Run: .venv/bin/python bench/plan_1000_nodes.py
The pool mixes NVIDIA A100 80 GB, H100 80 GB, L40S 48 GB, A10G 24 GB, AMD MI300X 192 GB and Intel Max 1550 128 GB
nodes; a quarter of the nodes have 2 GPUs taken by a running pod, 2% are cordoned and 2% NotReady. Llama-3-70B
at Q8_0 (75 GB in the file, kept at that size in its blocks) is planned free to choose, on the 24 GB nodes only (the
search then splits it over five GPUs), and there with at most 4 stages; each case is timed on its own.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Any

from strata.operator.planner import PlanOptions, plan_placement
from strata_testbed.cluster_objects import gpu_node, gpu_pod
from strata_testbed.model_shapes import Q8_0, llama3_70b

NODES = 1000
GPUS_PER_NODE = 8
RUNS = 50
# (node name prefix, GiB per GPU, resource)
KINDS = (
    ("a100", 80, "nvidia.com/gpu"),
    ("h100", 80, "nvidia.com/gpu"),
    ("l40s", 48, "nvidia.com/gpu"),
    ("a10g", 24, "nvidia.com/gpu"),
    ("mi300x", 192, "amd.com/gpu"),
    ("max1550", 128, "gpu.intel.com/xe"),
)


def build_pool() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    nodes: list[dict[str, Any]] = []
    pods: list[dict[str, Any]] = []
    for index in range(NODES):
        prefix, gib, resource = KINDS[index % len(KINDS)]
        name = f"{prefix}-{index:04d}"
        node = gpu_node(
            name,
            gpus=GPUS_PER_NODE,
            gib=gib,
            resource=resource,
            labels={"pool": prefix},
            ready=index % 50 != 7,
            unschedulable=index % 50 == 13,
        )
        nodes.append(node)
        if index % 4 == 0:
            pods.append(gpu_pod(f"train-{index}", node=name, gpus=2, resource=resource))
    return nodes, pods


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    nodes, pods = build_pool()
    model = llama3_70b(weight_type=Q8_0)
    constrained = PlanOptions(node_selector={"pool": "a10g"}, max_stages=4)
    cases = {
        "70B Q8_0, free choice": PlanOptions(),
        "70B Q8_0, a10g nodes only": PlanOptions(node_selector={"pool": "a10g"}),
        "70B Q8_0, a10g nodes only, <= 4 stages": constrained,
    }
    print(f"machine: {_cpu_name()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print(f"pool: {NODES} nodes x {GPUS_PER_NODE} GPUs ({len(pods)} pods holding GPUs), {RUNS} runs per plan")
    print(f"{'plan (1,000 nodes x 8 GPUs)':<42} {'median ms':>10} {'p95 ms':>8}  result")
    for label, options in cases.items():
        timings = []
        for _ in range(RUNS):
            start = time.perf_counter()
            plan = plan_placement(model=model, nodes=nodes, pods=pods, options=options)
            timings.append((time.perf_counter() - start) * 1000)
        timings.sort()
        p95 = timings[min(len(timings) - 1, int(len(timings) * 0.95))]
        result = f"{len(plan.stages)} stage(s), context {plan.context_length}, {len(plan.excluded)} nodes excluded"
        print(f"{label:<42} {statistics.median(timings):>10.1f} {p95:>8.1f}  {result}")


if __name__ == "__main__":
    main()
