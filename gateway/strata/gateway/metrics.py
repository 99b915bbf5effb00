"""Prometheus metrics of one gateway, in its own registry (no process-wide globals, so tests can run several).

The prefix cache's hits, misses and cached tokens are the coordinator's own counts (one per request); snapshots,
bytes held and evictions are the stages' figures, summed over the stages, as the last SavePrefix or RestorePrefix
reply carried them. Those, and the steps in flight, are one driver's figures: they carry a `pipeline` label, and
`for_pipeline` gives each driver its own view.

Per pipeline, for an autoscaler to target (strata_gateway_pipeline_*): lanes, lanes busy, KV cells in use, tokens
generated and tokens per second over the last minute, and whether it serves. They are read when scraped from the
router (PipelineCollector), so a pipeline that leaves leaves no stale series behind. The queue stays one gauge for
the gateway: a waiting request belongs to no pipeline until a lane comes free on one, so an autoscaler divides
strata_gateway_queue_depth by the sum of the pipelines' lanes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
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
        self.steps = Counter("strata_gateway_steps", "Steps the last stage answered", registry=r)
        self.step_positions = Counter(
            "strata_gateway_step_positions", "Positions the answered steps carried: prompt slices, tokens, drafts",
            registry=r,
        )  # fmt: skip
        self.ready = Gauge("strata_gateway_ready", "1 while the pipeline accepts requests", registry=r)
        self.speculative_drafted = Counter(
            "strata_gateway_speculative_drafted_tokens", "Tokens proposed by speculation for the stages to verify",
            registry=r,
        )  # fmt: skip
        self.speculative_accepted = Counter(
            "strata_gateway_speculative_accepted_tokens", "Proposed tokens the last stage's own picks matched",
            registry=r,
        )  # fmt: skip
        self.speculative_run = Histogram(
            "strata_gateway_speculative_run_tokens",
            "Tokens a step with a proposal yielded for its request: the accepted drafts plus the stage's own pick",
            buckets=tuple(range(1, 18)),
            registry=r,
        )
        self.speculative_off_steps = Counter(
            "strata_gateway_speculative_off_steps",
            "Steps whose lanes could draft but drafted nothing, since no draft would pay",
            registry=r,
        )
        self.speculative_draft_seconds = Counter(
            "strata_gateway_speculative_draft_seconds",
            "Seconds the driver waited for a draft model's proposals before writing a step",
            registry=r,
        )
        by = ["pipeline"]
        self._steps_in_flight = Gauge(
            "strata_gateway_steps_in_flight",
            "Steps written to the first stage whose replies have not come back (at most the micro-batches)",
            by,
            registry=r,
        )
        self._prefix_cache_hits = Counter(
            "strata_gateway_prefix_cache_hits", "Requests whose prompt prefix every stage restored", by, registry=r
        )
        self._prefix_cache_misses = Counter(
            "strata_gateway_prefix_cache_misses",
            "Requests long enough to share a chunk whose prefix no snapshot served (none known, or a stage lost it)",
            by,
            registry=r,
        )
        self._prefix_cache_cached_tokens = Counter(
            "strata_gateway_prefix_cache_cached_tokens", "Prompt tokens restored instead of prefilled", by, registry=r
        )
        self._prefix_cache_evictions = Counter(
            "strata_gateway_prefix_cache_evictions",
            "Snapshots the stages dropped to stay within their budgets, summed over the stages",
            by,
            registry=r,
        )
        self._prefix_cache_bytes = Gauge(
            "strata_gateway_prefix_cache_bytes",
            "Bytes of prefix snapshots held, summed over the stages",
            by,
            registry=r,
        )
        self._prefix_cache_snapshots = Gauge(
            "strata_gateway_prefix_cache_snapshots", "Prefix snapshots held, summed over the stages", by, registry=r
        )
        self._bind(0)

    def for_pipeline(self, index: int) -> GatewayMetrics:
        """A view for pipeline `index`'s driver: the same registry, its own labelled series."""
        view = copy.copy(self)
        view._bind(index)
        return view

    def _bind(self, index: int) -> None:
        label = str(index)
        self.steps_in_flight = self._steps_in_flight.labels(pipeline=label)
        self.prefix_cache_hits = self._prefix_cache_hits.labels(pipeline=label)
        self.prefix_cache_misses = self._prefix_cache_misses.labels(pipeline=label)
        self.prefix_cache_cached_tokens = self._prefix_cache_cached_tokens.labels(pipeline=label)
        self.prefix_cache_evictions = self._prefix_cache_evictions.labels(pipeline=label)
        self.prefix_cache_bytes = self._prefix_cache_bytes.labels(pipeline=label)
        self.prefix_cache_snapshots = self._prefix_cache_snapshots.labels(pipeline=label)
        self._stage_evictions = 0

    def observe_prefix_stages(self, stats: stage_pb2.PrefixCacheStats) -> None:
        """Take the stages' summed figures; their eviction count only grows, unless a stage restarted."""
        self.prefix_cache_bytes.set(stats.bytes_held)
        self.prefix_cache_snapshots.set(stats.snapshots)
        if stats.evictions > self._stage_evictions:
            self.prefix_cache_evictions.inc(stats.evictions - self._stage_evictions)
        self._stage_evictions = stats.evictions


@dataclass(frozen=True, kw_only=True)
class PipelineFigures:
    """One pipeline's figures at a scrape."""

    index: int
    ready: bool
    lanes: int
    busy: int
    kv_cells: int  # positions the active generations hold in the shared KV pool
    tokens: int  # generated since the gateway started driving it
    tokens_per_second: float


class PipelineCollector(Collector):
    """The strata_gateway_pipeline_* families, read from `figures` at each scrape."""

    def __init__(self, figures: Callable[[], Sequence[PipelineFigures]]) -> None:
        self._figures = figures

    def describe(self) -> list[Metric]:
        return []  # families are built at collect time, from whatever pipelines exist then

    def collect(self) -> Iterator[Metric]:
        figures = self._figures()
        gauges: dict[str, tuple[str, Callable[[PipelineFigures], float]]] = {
            "ready": ("1 while the pipeline serves", lambda f: float(f.ready)),
            "lanes": ("Lanes (parallel slots) of the pipeline", lambda f: f.lanes),
            "lanes_busy": ("Lanes of the pipeline held by requests", lambda f: f.busy),
            "kv_cells_in_use": ("KV cells the pipeline's active requests hold", lambda f: f.kv_cells),
            "tokens_per_second": ("Tokens generated per second, over the last minute", lambda f: f.tokens_per_second),
        }
        for name, (help_text, value) in gauges.items():
            family = GaugeMetricFamily(f"strata_gateway_pipeline_{name}", help_text, labels=["pipeline"])
            for f in figures:
                family.add_metric([str(f.index)], value(f))
            yield family
        tokens = CounterMetricFamily(
            "strata_gateway_pipeline_tokens_generated", "Tokens the pipeline generated", labels=["pipeline"]
        )
        for f in figures:
            tokens.add_metric([str(f.index)], f.tokens)
        yield tokens
