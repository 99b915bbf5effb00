"""How a ModelDeployment's pipelines roll out and scale (strata.operator.spec's rollout and autoscaling)."""

from __future__ import annotations

from pydantic import ConfigDict, Field, model_validator
from strata.draining import DRAIN_S
from strata.operator.spec_fields import (
    SpecPart,
    WholeNumber,
    cel,
)


class Rollout(SpecPart):
    max_unavailable: int = Field(
        default=1,
        alias="maxUnavailable",
        ge=1,
        le=64,
        description=(
            "Serving pipelines a re-plan replaces at once; each keeps serving its old generation until its new one "
            "is ready. With 2 or more replicas at most replicas - 1, so one pipeline is untouched by a rollout."
        ),
    )
    drain_seconds: int = Field(
        default=int(DRAIN_S),
        alias="drainSeconds",
        ge=1,
        le=3600,
        description=(
            "Seconds a pipeline leaving service (scaled down, or replaced by a rollout) has to finish the requests it "
            "runs; what still runs then fails with a retryable 503. Its stage pods stay this long plus the gateway's "
            "poll period and a few seconds, holding their GPUs."
        ),
    )


class Autoscaling(SpecPart):
    """Pipelines added while requests queue and removed once idle, by the operator, on what the gateway observes.

    The operator writes spec.replicas as an HPA would, so `kubectl get` and the scale subresource show the count; a
    manual `kubectl scale` lasts until the next decision. Leave spec.autoscaling out to drive replicas with an HPA or
    KEDA instead (two scalers would fight).
    """

    model_config = ConfigDict(
        extra="forbid",
        populate_by_name=True,
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("self.minReplicas <= self.maxReplicas", "autoscaling needs minReplicas <= maxReplicas")
            ]
        },
    )

    min_replicas: WholeNumber = Field(
        default=1,
        alias="minReplicas",
        ge=0,
        le=64,
        description=(
            "Fewest pipelines. With 0 an idle deployment keeps no stage pod; the gateway stays up, holds the next "
            "request while a pipeline loads (coldStartWaitSeconds) and answers 503 with Retry-After after that."
        ),
    )
    max_replicas: WholeNumber = Field(alias="maxReplicas", ge=1, le=64, description="Most pipelines.")
    target_queue_per_lane: float = Field(
        default=0.5,
        alias="targetQueuePerLane",
        gt=0,
        le=64,
        description="Requests waiting per serving lane above which a pipeline is added (after scaleUpDelaySeconds).",
    )
    scale_up_delay_seconds: int = Field(
        default=5,
        alias="scaleUpDelaySeconds",
        ge=0,
        le=3600,
        description="How long the queue stays above the target before a pipeline is added; one is added at a time.",
    )
    scale_down_delay_seconds: int = Field(
        default=300,
        alias="scaleDownDelaySeconds",
        ge=0,
        le=86400,
        description=(
            "How long nothing waits and the busy lanes fit in one pipeline fewer before one is removed "
            "(and between removals)."
        ),
    )
    cold_start_wait_seconds: float = Field(
        default=60.0,
        alias="coldStartWaitSeconds",
        gt=0,
        le=600,
        description="Longest a request is held while no pipeline serves, before HTTP 503 with the load progress.",
    )

    @model_validator(mode="after")
    def _ordered(self) -> Autoscaling:
        """The CEL rule again, for manifests that reach the handlers without the API server's check."""
        if self.min_replicas > self.max_replicas:
            raise ValueError("autoscaling needs minReplicas <= maxReplicas")
        return self
