"""`strata plan MODEL --nodes FILE`: where a model would run on a pool, before anything is deployed.

FILE is what `kubectl get nodes,pods -A -o yaml` prints (a v1 List) or a NodeList, so a platform team can answer
"does this model fit, with how much context?" from a snapshot of the cluster. Exit status: 0 a plan, 2 it does not
fit (a shortfall, or an override that cannot be honoured), 1 bad input. This is the thin executor beside the pure
planner: it reads the file and the model header, and prints.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from strata.gguf.model import CacheType
from strata.plan import Plan
from strata.quantity import quantity_to_bytes

EXIT_PLAN = 0
EXIT_BAD_INPUT = 1
EXIT_DOES_NOT_FIT = 2


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("plan", help="plan a GGUF model's layer split over a pool of GPU nodes")
    parser.add_argument("model", metavar="MODEL", help="path or URL of a .gguf file (read from its header)")
    parser.add_argument("--nodes", required=True, type=Path, metavar="FILE", help="`kubectl get nodes,pods -A -o yaml`")
    parser.add_argument("--context", type=int, help="context length (default: the longest that fits)")
    parser.add_argument("--parallel", type=int, help="parallel slots sharing the KV pool (default 4)")
    cache_types = [t.value for t in CacheType]
    parser.add_argument("--cache-type-k", choices=cache_types, help="KV cache type for keys (default q8_0)")
    parser.add_argument("--cache-type-v", choices=cache_types, help="KV cache type for values (default q8_0)")
    parser.add_argument("--max-stages", type=int, help="at most this many stages (GPUs)")
    parser.add_argument(
        "--prefix-cache-percent",
        type=float,
        help="share of what weights and buffers leave that each stage keeps for prefix snapshots (default 5; 0: none)",
    )
    parser.add_argument(
        "--kv-host-memory",
        metavar="QUANTITY",
        help="host memory per stage for KV blocks its GPU lets go of, as spec.kvCache.hostMemory (e.g. 64Gi)",
    )
    parser.add_argument(
        "--resident-window",
        type=int,
        metavar="TOKENS",
        help="decode attends over this many positions a slot at most, as spec.kvCache.residentWindow.tokens (the "
        "default 64 sink and 1024 recent tokens)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from strata.gguf import GGUFError, inspect_model
    from strata.kv_layout import ResidentBudget
    from strata.operator.planner import PlanOptions, plan_placement
    from strata.operator.planner.errors import OverrideDoesNotFitError, PlanningError

    try:
        host_kv_bytes = None if args.kv_host_memory is None else quantity_to_bytes(args.kv_host_memory)
    except ValueError as error:
        print(f"strata plan: --kv-host-memory {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        nodes, pods = read_cluster_objects(args.nodes)
        model = inspect_model(args.model)
        given = {
            "context_length": args.context,
            "parallel": args.parallel,
            "cache_type_k": None if args.cache_type_k is None else CacheType(args.cache_type_k),
            "cache_type_v": None if args.cache_type_v is None else CacheType(args.cache_type_v),
            "max_stages": args.max_stages,
            "prefix_cache_fraction": None if args.prefix_cache_percent is None else args.prefix_cache_percent / 100,
            "host_kv_bytes": host_kv_bytes,
            "resident_window": None if args.resident_window is None else ResidentBudget(tokens=args.resident_window),
        }
        options = PlanOptions(**{name: value for name, value in given.items() if value is not None})
        plan = plan_placement(model=model, nodes=nodes, pods=pods, options=options)
    except OverrideDoesNotFitError as error:
        print(f"strata plan: does not fit: {error}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    except (GGUFError, PlanningError, ClusterFileError) as error:
        print(f"strata plan: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(plan.model_dump(mode="json"), indent=2) if args.json else to_table(plan))
    return EXIT_PLAN if plan.feasible else EXIT_DOES_NOT_FIT


class ClusterFileError(ValueError):
    """The --nodes file is not a List, NodeList or PodList of the API's objects."""


def read_cluster_objects(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Nodes and Pods from a v1 List (items carry their kind), a NodeList or a PodList."""
    import yaml

    try:
        document = yaml.safe_load(path.read_text())
    except OSError as error:
        raise ClusterFileError(f"--nodes {path}: {error.strerror or error}") from None
    except yaml.YAMLError as error:
        raise ClusterFileError(f"--nodes {path}: not YAML: {error}") from None
    if not isinstance(document, dict) or not isinstance(document.get("items"), list):
        raise ClusterFileError(f"--nodes {path}: expected a List or NodeList with items (kubectl get nodes -o yaml)")
    implied = {"NodeList": "Node", "PodList": "Pod"}.get(str(document.get("kind")))
    nodes: list[dict[str, Any]] = []
    pods: list[dict[str, Any]] = []
    for item in document["items"]:
        kind = item.get("kind", implied) if isinstance(item, dict) else None
        if kind == "Node":
            nodes.append(item)
        elif kind == "Pod":
            pods.append(item)
    if not nodes:
        raise ClusterFileError(f"--nodes {path}: no Node objects in {len(document['items'])} items")
    return nodes, pods


def gb(count: int) -> str:
    return f"{count / 1e9:.1f}"


def to_table(plan: Plan) -> str:
    lines = []
    header: tuple[str, ...]
    rows: list[tuple[str, ...]]
    if plan.feasible:
        lines.append(
            f"context {plan.context_length} tokens, {plan.parallel} parallel slots, KV {plan.cache_type_k}/"
            f"{plan.cache_type_v} ({plan.kv_bytes_per_token} B/token over all layers)"
            + (
                ""
                if plan.resident_window is None
                else f", decode over a resident window of {plan.resident_window.tokens} tokens"
            )
        )
        header = (
            "STAGE",
            "NODE",
            "GPU",
            "BACKEND",
            "LAYERS",
            "WEIGHTS GB",
            "KV GB",
            "PREFIX GB",
            "HOST KV GB",
            "BUFFERS GB",
            "USABLE GB",
            "SPARE GB",
        )
        rows = [
            (
                str(s.index),
                s.node,
                ",".join(map(str, s.gpus)),
                s.backend.value,
                f"{s.layer_start}-{s.layer_end - 1}"
                + (" +embd" if s.embeddings else "")
                + (" +head" if s.output_head else ""),
                gb(s.weight_bytes),
                gb(s.kv_bytes),
                gb(s.prefix_cache_bytes),
                gb(s.host_kv_bytes),
                gb(s.buffer_bytes),
                gb(s.usable_bytes),
                gb(s.spare_bytes),
            )
            for s in plan.stages
        ]
        lines += _columns([header, *rows])
    elif plan.shortfall is not None:
        lines.append(f"does not fit: {plan.shortfall.message}")
        header = ("NODE", "GPU", "USABLE GB", "WEIGHTS GB", "KV GB")
        rows = [
            (p.node, str(p.gpu), gb(p.usable_bytes), gb(p.weight_bytes), gb(p.kv_bytes))
            for p in plan.shortfall.participants
        ]
        lines += _columns([header, *rows])
    if plan.excluded:
        lines.append("")
        lines += _columns([("EXCLUDED NODE", "REASON"), *((e.node, e.reason) for e in plan.excluded)])
    return "\n".join(lines)


def _columns(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
