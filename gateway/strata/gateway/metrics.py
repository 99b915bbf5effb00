"""Prometheus metrics of one gateway, in its own registry (no process-wide globals, so tests can run several).

The prefix cache's hits, misses and cached tokens are the coordinator's own counts (one per request); snapshots,
bytes held and evictions are the stages' figures, summed over the stages, as the last SavePrefix or RestorePrefix
reply carried them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from strata.rpc.v1 import stage_pb2

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.lanes_busy = Gauge("strata_gateway_lanes_busy", "Lanes (pipeline slots) held by requests", registry=r)
        self.queue_depth = Gauge("strata_gateway_queue_depth", "Requests waiting for a lane", registry=r)
        self.admitted = Counter("strata_gateway_admitted", "Requests given a lane", registry=r)
        self.rejected = Counter(
            "strata_gateway_rejected", "Requests refused with 429, by reason", ["reason"], registry=r
        )
        self.time_to_first_token = Histogram(
            "strata_gateway_time_to_first_token_seconds",
            "From admission to the first generated token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "strata_gateway_inter_token_latency_seconds",
            "Between consecutive generated tokens of one request",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens_generated = Counter("strata_gateway_tokens_generated", "Tokens sampled for clients", registry=r)
        self.prompt_tokens = Counter("strata_gateway_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.ready = Gauge("strata_gateway_ready", "1 while the pipeline accepts requests", registry=r)
        self.steps_in_flight = Gauge(
            "strata_gateway_steps_in_flight",
            "Steps written to the first stage whose replies have not come back (at most the micro-batches)",
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "strata_gateway_prefix_cache_hits", "Requests whose prompt prefix every stage restored", registry=r
        )
        self.prefix_cache_misses = Counter(
            "strata_gateway_prefix_cache_misses",
            "Requests long enough to share a chunk whose prefix no snapshot served (none known, or a stage lost it)",
            registry=r,
        )
        self.prefix_cache_cached_tokens = Counter(
            "strata_gateway_prefix_cache_cached_tokens", "Prompt tokens restored instead of prefilled", registry=r
        )
        self.prefix_cache_evictions = Counter(
            "strata_gateway_prefix_cache_evictions",
            "Snapshots the stages dropped to stay within their budgets, summed over the stages",
            registry=r,
        )
        self.prefix_cache_bytes = Gauge(
            "strata_gateway_prefix_cache_bytes", "Bytes of prefix snapshots held, summed over the stages", registry=r
        )
        self.prefix_cache_snapshots = Gauge(
            "strata_gateway_prefix_cache_snapshots", "Prefix snapshots held, summed over the stages", registry=r
        )
        self._stage_evictions = 0

    def observe_prefix_stages(self, stats: stage_pb2.PrefixCacheStats) -> None:
        """Take the stages' summed figures; their eviction count only grows, unless a stage restarted."""
        self.prefix_cache_bytes.set(stats.bytes_held)
        self.prefix_cache_snapshots.set(stats.snapshots)
        if stats.evictions > self._stage_evictions:
            self.prefix_cache_evictions.inc(stats.evictions - self._stage_evictions)
        self._stage_evictions = stats.evictions
