"""The ModelDeployment status: conditions with observedGeneration, the plan summary, load progress, endpoint.

Condition types and Event reasons are constants, so a script (or a person reading `kubectl describe`) can rely on
them; the reconciler writes the whole status object each time it acts.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer
from strata.modeldeployment import COORDINATOR_FENCED

MAX_CONDITION_MESSAGE_CHARS = 32768  # the API's limit on a condition's message


class ConditionType(StrEnum):
    PLANNED = "Planned"
    CAPACITY_AVAILABLE = "CapacityAvailable"
    STAGES_READY = "StagesReady"
    GATEWAY_READY = "GatewayReady"
    READY = "Ready"


class EventReason(StrEnum):
    PLANNED = "Planned"
    CAPACITY_SHORTFALL = "CapacityShortfall"
    REPLANNED = "Replanned"
    STAGE_LOST = "StageLost"
    LOAD_FAILED = "LoadFailed"  # also StagesReady's reason while a stage reports that its load failed
    CUT_OVER = "CutOver"
    INVALID_SPEC = "InvalidSpec"
    MODEL_UNREADABLE = "ModelUnreadable"
    MODEL_NOT_EXECUTABLE = "ModelNotExecutable"  # also Planned's reason: Strata's stages do not run the model
    COORDINATOR_CHANGED = "CoordinatorChanged"
    SCALED = "Scaled"  # the autoscaler changed spec.replicas
    COORDINATOR_FENCED = COORDINATOR_FENCED  # recorded by the gateway, listed here with the others


class Phase(StrEnum):
    PENDING = "Pending"
    LOADING = "Loading"
    READY = "Ready"
    SHORTFALL = "Shortfall"
    FAILED = "Failed"
    CHANGE_REFUSED = "ChangeRefused"  # the newest spec cannot be planned or loaded; an older generation serves
    SCALED_TO_ZERO = "ScaledToZero"  # replicas 0: no stage runs, the gateway waits for a request


class _Status(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Condition(_Status):
    type: ConditionType
    status: str = Field(pattern="^(True|False|Unknown)$")
    reason: str = Field(pattern="^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", max_length=1024)
    message: str = Field(default="", max_length=MAX_CONDITION_MESSAGE_CHARS)
    observed_generation: int = Field(default=0, alias="observedGeneration", ge=0)
    last_transition_time: str = Field(alias="lastTransitionTime")


class StageSummary(_Status):
    index: int = Field(ge=0)
    node: str
    gpus: int = Field(ge=1)
    backend: str
    layer_start: int = Field(alias="layerStart", ge=0)
    layer_end: int = Field(alias="layerEnd", ge=0)
    kv_bytes: int = Field(default=0, alias="kvBytes", ge=0, description="Resident KV on its GPU at the context.")
    host_kv_bytes: int = Field(
        default=0, alias="hostKVBytes", ge=0, description="Host memory for KV blocks its GPU lets go of."
    )


class PlanSummary(_Status):
    generation: int = Field(ge=1, description="Grows by one with every new plan.")
    spec_generation: int | None = Field(
        default=None, alias="specGeneration", ge=1, description="The ModelDeployment's generation it was planned from."
    )
    stages: list[StageSummary]
    context_length: int = Field(alias="contextLength", ge=0)
    parallel: int = Field(ge=1)
    cache_type_k: str = Field(alias="cacheTypeK")
    cache_type_v: str = Field(alias="cacheTypeV")
    # 0, not None, when there is none: the API server drops a nested null, and a status that keeps writing a field
    # the server keeps dropping is written on every pass (tests/operator/test_operator_watches.py caught it).
    resident_window_tokens: int = Field(
        default=0,
        alias="residentWindowTokens",
        ge=0,
        description="Positions a slot's decode step attends over at most (spec.kvCache.residentWindow); 0: all.",
    )


class LoadProgress(_Status):
    stage: int = Field(ge=0)
    bytes_loaded: int = Field(alias="bytesLoaded", ge=0)
    bytes_total: int = Field(alias="bytesTotal", ge=0)


class Excluded(_Status):
    node: str
    reason: str


class Coordinator(_Status):
    """The gateway replica that holds the coordinator Lease, and its term (the Lease's transitions)."""

    holder: str
    term: int = Field(ge=0)


class PipelineStatus(_Status):
    """One pipeline: the plan it loads, the one it serves, and why it has none when the pool is short."""

    index: int = Field(ge=0)
    plan: PlanSummary | None = Field(default=None, description="Its newest plan; its stages may still be loading.")
    serving: PlanSummary | None = Field(default=None, description="The plan it serves with, once all stages are ready.")
    ready: bool = Field(default=False, description="Every stage of its serving plan is ready.")
    shortfall: str | None = Field(default=None, description="Why the pool holds no placement for it.")

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Unset fields are left out: the API server drops a null inside a list item, so a status that sent one
        would differ from the stored status on every pass and be written again."""
        return {key: value for key, value in handler(self).items() if value is not None}


class RetiringGeneration(_Status):
    """A generation that left the plan while the gateway may have been driving it (strata.operator.retirement)."""

    generation: int = Field(ge=1)
    pipeline: int = Field(ge=0, description="The pipeline it served.")
    since: str = Field(description="When it left; its stages go once the gateway's drain bound has passed since.")


class ObservedDemand(_Status):
    """What the coordinator gateway last reported (strata.demand), as the autoscaler read it."""

    lanes: int = Field(ge=0, description="Lanes of the pipelines that serve.")
    busy: int = Field(ge=0, description="Lanes held by requests.")
    queue: int = Field(ge=0, description="Requests waiting for a lane.")
    held: int = Field(ge=0, description="Requests held while no pipeline serves.")


class AutoscalingStatus(_Status):
    """The autoscaler's last decision and the timers it keeps across passes (and across operator failovers)."""

    desired_replicas: int = Field(alias="desiredReplicas", ge=0, description="Pipelines it asks for.")
    reason: str = Field(description="A constant: BelowMinimum, ColdStart, QueueAboveTarget, Idle, Steady, ...")
    message: str = Field(default="", max_length=1024)
    demand: ObservedDemand | None = Field(default=None, description="The gateway's figures it decided on.")
    pressure_since: str | None = Field(
        default=None, alias="pressureSince", description="Since when requests queue above the target."
    )
    idle_since: str | None = Field(default=None, alias="idleSince", description="Since when nothing waits.")
    last_scale_time: str | None = Field(default=None, alias="lastScaleTime", description="When it last scaled.")

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Unset fields are left out: a merge patch drops a nested null, so a status that sent one would differ from
        the stored status on every pass and be written again."""
        return {key: value for key, value in handler(self).items() if value is not None}


class ModelDeploymentStatus(_Status):
    observed_generation: int = Field(default=0, alias="observedGeneration", ge=0)
    phase: Phase = Phase.PENDING
    reason: str = Field(default="", description="Why the phase is what it is: a reason of the conditions.")
    conditions: list[Condition] = Field(default_factory=list)
    model_name: str | None = Field(default=None, alias="modelName")
    plan: PlanSummary | None = Field(
        default=None, description="Pipeline 0's newest plan; its stages may still be loading."
    )
    serving: PlanSummary | None = Field(
        default=None, description="The plan the gateway uses (pipeline 0's): the newest once all its stages are ready."
    )
    pipelines: list[PipelineStatus] = Field(default_factory=list, description="Every pipeline, in index order.")
    replicas: int = Field(default=0, ge=0, description="Pipelines placed (the scale subresource's replicas).")
    ready_replicas: int = Field(default=0, alias="readyReplicas", ge=0, description="Pipelines serving.")
    pipelines_ready: str = Field(
        default="0/0", alias="pipelinesReady", description="Pipelines serving over pipelines asked for."
    )
    selector: str = Field(default="", description="Label selector of the stage pods (the scale subresource's).")
    stage_count: int = Field(default=0, alias="stageCount", ge=0)
    context_length: int = Field(default=0, alias="contextLength", ge=0)
    ready: str = Field(default="0/0", description="Ready stages over planned stages.")
    shortfall: str | None = None
    excluded: list[Excluded] = Field(default_factory=list)
    load_progress: list[LoadProgress] = Field(default_factory=list, alias="loadProgress")
    coordinator: Coordinator | None = None
    retiring: list[RetiringGeneration] = Field(
        default_factory=list,
        description="Generations whose stages stay while the gateway drains the requests still running on them.",
    )
    autoscaling: AutoscalingStatus | None = Field(default=None, description="Set while spec.autoscaling is.")
    endpoint: str | None = None
