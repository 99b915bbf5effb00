"""`strata operator`: run the reconciler under kopf, only while this replica holds the operator Lease.

Availability comes from several replicas of which exactly one acts. We use our own Lease election (strata.lease)
rather than kopf's peering: peering pauses every operator when two share a priority, and a Lease gives the same
acquire/renew/expire semantics the gateway's coordinator uses. A replica that cannot renew within the deadline
stops kopf and exits, before the Lease expires for the standby.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client import Gauge

DEFAULT_IMAGE = "strata:0.1.0"
CACHE_SYNC_SECONDS = 120.0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("operator", help="run the ModelDeployment operator")
    parser.add_argument(
        "--namespace",
        action="append",
        dest="namespaces",
        default=[],
        help="watch this namespace (repeatable); all namespaces when omitted",
    )
    parser.add_argument("--json-logs", action="store_true", help="log one JSON object per line")
    parser.add_argument(
        "--image",
        default=os.environ.get("STRATA_IMAGE", DEFAULT_IMAGE),
        help="image for stage and gateway pods (env STRATA_IMAGE)",
    )
    parser.add_argument(
        "--lease-namespace",
        default=os.environ.get("STRATA_OPERATOR_NAMESPACE", "default"),
        help="namespace of the operator's leader-election Lease (env STRATA_OPERATOR_NAMESPACE)",
    )
    parser.add_argument("--lease-name", default="strata-operator")
    parser.add_argument("--identity", default=os.environ.get("POD_NAME", socket.gethostname()))
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve Prometheus metrics on this port, on standby replicas too (0: off)",
    )
    parser.add_argument(
        "--kubeconfig",
        default=os.environ.get("KUBECONFIG"),
        help="kubeconfig path; in-cluster configuration when omitted",
    )
    parser.set_defaults(run=run)


def _api_client(kubeconfig: str | None) -> Any:
    from kubernetes import config

    if kubeconfig:
        return config.new_client_from_config(config_file=kubeconfig)
    config.load_incluster_config()
    from kubernetes import client

    return client.ApiClient()


def _serve_metrics(port: int) -> Gauge:
    """A gauge that says whether this replica leads, with the process metrics, when a port is given."""
    from prometheus_client import Gauge, start_http_server

    leader = Gauge("strata_operator_leader", "1 while this replica holds the operator Lease")
    if port:
        start_http_server(port)
    return leader


def run(args: argparse.Namespace) -> int:
    import kopf
    from kubernetes import client
    from strata.lease import LeaseElector, LeaseTiming
    from strata.operator import handlers
    from strata.operator.cluster_cache import CacheNotSynced, ClusterCache
    from strata.operator.doorbells import Doorbells
    from strata.operator.kube import Cluster
    from strata.operator.models import ModelCache
    from strata.operator.reconcile import Reconciler
    from strata.operator.status_writer import StatusWriter

    kopf.configure(log_format=kopf.LogFormat.JSON if args.json_logs else kopf.LogFormat.PLAIN)
    log = logging.getLogger("strata.operator")
    api_client = _api_client(args.kubeconfig)
    # The operator's Lease lives in the operator's own namespace (the chart sets STRATA_OPERATOR_NAMESPACE from the
    # pod), which is also where stage NetworkPolicies must admit it from.
    doorbells = Doorbells()
    cache = ClusterCache(api_client, namespaces=args.namespaces, doorbells=doorbells)
    cluster = Cluster(api_client, cache)
    reconciler = Reconciler(
        cluster=cluster, models=ModelCache(), image=args.image, operator_namespace=args.lease_namespace
    )
    handlers.install(reconciler, writer=StatusWriter(cluster), doorbells=doorbells)

    timing = LeaseTiming()
    elector = LeaseElector(
        api=client.CoordinationV1Api(api_client),
        namespace=args.lease_namespace,
        name=args.lease_name,
        identity=args.identity,
        timing=timing,
    )
    leader = _serve_metrics(args.metrics_port)
    stop = threading.Event()
    leading = threading.Event()
    lost = threading.Event()

    def elect() -> None:
        while not stop.is_set():
            token = elector.try_acquire_or_renew()
            if token is not None and not leading.is_set():
                log.info("leading as %s with term %d", args.identity, token.term)
                leader.set(1)
                leading.set()
            elif token is None and leading.is_set():
                log.error("lost the operator Lease: stopping so the new leader acts alone")
                leader.set(0)
                lost.set()
                stop.set()
                return
            stop.wait(timing.retry_period_seconds)

    threading.Thread(target=elect, name="lease", daemon=True).start()
    log.info("waiting for the operator Lease %s/%s", args.lease_namespace, args.lease_name)
    while not leading.wait(timeout=1.0):
        if stop.is_set():
            return 1
    try:
        # Only the leader watches, and it acts only once every watch has listed: a pool half read would look
        # like nodes lost. A standby that takes over builds the same view from scratch before its first reconcile.
        try:
            cache.start(timeout=CACHE_SYNC_SECONDS)
        except CacheNotSynced as e:
            log.error("%s", e)
            return 1
        log.info("the pool is watched: %d nodes, %d GPU pods", len(cache.nodes.items()), len(cache.pods.items()))
        kopf.run(
            standalone=True,
            clusterwide=not args.namespaces,
            namespaces=args.namespaces,
            stop_flag=stop,
        )
    finally:
        stop.set()
        cache.stop()
        if not lost.is_set():
            elector.release()
    return 1 if lost.is_set() else 0
