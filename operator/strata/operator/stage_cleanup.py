"""The thin executor of strata.operator.retirement: status.retiring in and out, and the stage sets it lets go.

Every place that used to delete the generations no pipeline uses goes through here, so a generation the gateway may
be draining is never deleted before its bound, whichever change (a scale-down, a re-plan's cut-over) retired it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from strata.draining import retire_after_s
from strata.operator.kube import Cluster
from strata.operator.replicas import generations_in_use
from strata.operator.retirement import Retirement, Retiring, retire
from strata.operator.status import ModelDeploymentStatus, PipelineStatus, RetiringGeneration
from strata.operator.timestamps import seconds, stamp


def listed(pipelines: Iterable[PipelineStatus]) -> dict[int, int]:
    """generation -> pipeline of what the gateway may be driving: each ready pipeline's serving generation (the
    gateway drives exactly those, strata.gateway.pipeline_list)."""
    return {p.serving.generation: p.index for p in pipelines if p.ready and p.serving is not None}


def settle_retirement(
    status: ModelDeploymentStatus,
    *,
    pipelines: Iterable[PipelineStatus],
    listed_before: dict[int, int],
    poll_s: float,
    drain_s: float,
    now: float,
) -> Retirement:
    """Decide over `pipelines` as they are after the change, and write what still retires into status.retiring."""
    earlier = [Retiring(generation=r.generation, pipeline=r.pipeline, since=seconds(r.since)) for r in status.retiring]
    decision = retire(
        listed=listed_before,
        in_use=generations_in_use(pipelines),
        retiring=earlier,
        now=now,
        after_s=retire_after_s(poll_s=poll_s, drain_s=drain_s),
    )
    # Stamped to the second, rounded up: a truncated stamp would end the bound early.
    status.retiring = [
        RetiringGeneration(generation=r.generation, pipeline=r.pipeline, since=stamp(math.ceil(r.since)))
        for r in decision.retiring
    ]
    return decision


def delete_unkept(cluster: Cluster, *, namespace: str, deployment: str, decision: Retirement) -> list[str]:
    """Delete the stage sets of every generation the decision does not keep; the names deleted."""
    return cluster.delete_other_generations(namespace=namespace, deployment=deployment, keep=set(decision.keep))
