"""The ModelDeployment spec: one typed pydantic model that validates in the handlers and generates the CRD.

Field names are the camelCase the API server stores; constraints that the API server can check (ranges, enums,
patterns, CEL rules for cross-field checks) live here so that `crds/` is generated from them and a bad manifest is
refused at `kubectl apply` time with a field-level message.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import ConfigDict, Field, model_validator
from strata.gguf.model import CacheType
from strata.kv_layout import ResidentBudget
from strata.modeldeployment import GROUP as GROUP
from strata.modeldeployment import KIND as KIND
from strata.modeldeployment import PLURAL as PLURAL
from strata.modeldeployment import VERSION as VERSION
from strata.operator.spec_fields import (
    DNS_SUBDOMAIN_PATTERN,
    ModelSource,
    Quantity,
    SecretKeyRef,
    SpecPart,
    WholeNumber,
    cel,
)
from strata.operator.spec_scaling import Autoscaling, Rollout
from strata.operator.spec_speculative import Speculative


class TolerationOperator(StrEnum):
    EXISTS = "Exists"
    EQUAL = "Equal"


class TaintEffect(StrEnum):
    NO_SCHEDULE = "NoSchedule"
    PREFER_NO_SCHEDULE = "PreferNoSchedule"
    NO_EXECUTE = "NoExecute"


class Toleration(SpecPart):
    key: str | None = Field(default=None, max_length=316, description="Taint key; empty with Exists matches all.")
    operator: TolerationOperator = Field(default=TolerationOperator.EQUAL, description="As in a Pod's tolerations.")
    value: str | None = Field(default=None, max_length=63, description="Taint value, with Equal.")
    effect: TaintEffect | None = Field(default=None, description="Taint effect to match; empty matches all.")
    toleration_seconds: int | None = Field(
        default=None, alias="tolerationSeconds", ge=0, description="How long a NoExecute taint is tolerated."
    )


class Placement(SpecPart):
    node_selector: dict[str, str] = Field(
        default_factory=dict, alias="nodeSelector", description="Only nodes with these labels take stages."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=32, description="Taints the stage pods tolerate (a tainted node is out)."
    )
    max_stages: int | None = Field(
        default=None, alias="maxStages", ge=1, le=64, description="At most this many stages (one GPU each)."
    )
    gpu_memory: Quantity | None = Field(
        default=None, alias="gpuMemory", description="Memory per GPU, overriding the nodes' GPU labels."
    )
    headroom_percent: int = Field(
        default=10,
        alias="headroomPercent",
        ge=0,
        le=90,
        description="GPU memory kept free, in percent (at least the backend's runtime overhead).",
    )


class Admission(SpecPart):
    queue_per_lane: int = Field(
        default=1, alias="queuePerLane", ge=0, le=64, description="Requests that may wait per lane when all are busy."
    )
    max_wait_seconds: float = Field(
        default=10.0, alias="maxWaitSeconds", gt=0, le=600, description="Longest wait for a lane before HTTP 429."
    )
    retry_after_seconds: int = Field(
        default=1, alias="retryAfterSeconds", ge=1, le=3600, description="Retry-After sent with HTTP 429."
    )


class Resources(SpecPart):
    requests: dict[str, Quantity] = Field(default_factory=dict, description="As in a container's resources.")
    limits: dict[str, Quantity] = Field(default_factory=dict, description="As in a container's resources.")


class Ingress(SpecPart):
    host: str = Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253, description="Host name clients use.")
    class_name: str | None = Field(
        default=None, alias="className", max_length=253, description="IngressClass; the cluster default if empty."
    )
    tls_secret_name: str | None = Field(
        default=None, alias="tlsSecretName", pattern=DNS_SUBDOMAIN_PATTERN, description="TLS Secret for the host."
    )


class ApiKeySecretRef(SecretKeyRef):
    key: str = Field(
        default="api-keys", min_length=1, max_length=253, description="Key holding the API keys, one per line."
    )


class Gateway(SpecPart):
    replicas: int = Field(
        default=1, ge=1, le=16, description="Gateway pods; one coordinates, the others serve by forwarding to it."
    )
    resources: Resources = Field(default_factory=Resources, description="The gateway container's resources.")
    ingress: Ingress | None = Field(default=None, description="An Ingress in front of /v1; none if unset.")
    api_key_secret_ref: ApiKeySecretRef | None = Field(
        default=None,
        alias="apiKeySecretRef",
        description="Secret whose key lists the API keys clients must send; the gateway gets it as STRATA_API_KEYS.",
    )


class LabelSelector(SpecPart):
    match_labels: dict[str, str] = Field(
        default_factory=dict, alias="matchLabels", max_length=32, description="Labels the peers carry."
    )


class MetricsScraper(SpecPart):
    """Who may scrape: pods matching podSelector in namespaces matching namespaceSelector (as in a NetworkPolicy)."""

    model_config = ConfigDict(
        extra="forbid",
        populate_by_name=True,
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "has(self.namespaceSelector) || has(self.podSelector)",
                    "a metrics scraper names a namespaceSelector, a podSelector or both",
                )
            ]
        },
    )

    namespace_selector: LabelSelector | None = Field(
        default=None, alias="namespaceSelector", description="Namespaces of the scrapers."
    )
    pod_selector: LabelSelector | None = Field(default=None, alias="podSelector", description="Pods of the scrapers.")

    @model_validator(mode="after")
    def _names_a_peer(self) -> MetricsScraper:
        if self.namespace_selector is None and self.pod_selector is None:
            raise ValueError("a metrics scraper names a namespaceSelector, a podSelector or both")
        return self


class NetworkPolicy(SpecPart):
    enabled: bool = Field(
        default=True,
        description="Render NetworkPolicies: the gateway alone reaches stage 0, stage i alone reaches stage i+1.",
    )
    metrics_from: list[MetricsScraper] = Field(
        default_factory=list,
        alias="metricsFrom",
        max_length=16,
        description="Scrapers allowed to reach a container port named `metrics` on stage and gateway pods.",
    )


class Coordination(SpecPart):
    """How the gateway replicas elect the coordinator that drives the stages (a coordination.k8s.io Lease).

    A standby takes over at most leaseDurationSeconds after the coordinator stops renewing; a coordinator that
    cannot renew for renewDeadlineSeconds stops using its term first, so two never act at once.
    """

    model_config = ConfigDict(
        extra="forbid",
        populate_by_name=True,
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.retryPeriodSeconds < self.renewDeadlineSeconds "
                    "&& self.renewDeadlineSeconds < self.leaseDurationSeconds",
                    "coordination needs retryPeriodSeconds < renewDeadlineSeconds < leaseDurationSeconds",
                )
            ]
        },
    )

    lease_duration_seconds: WholeNumber = Field(
        default=15, alias="leaseDurationSeconds", ge=3, le=300, description="How long a silent coordinator is trusted."
    )
    renew_deadline_seconds: WholeNumber = Field(
        default=10,
        alias="renewDeadlineSeconds",
        ge=2,
        le=299,
        description="A coordinator unrenewed this long steps down.",
    )
    retry_period_seconds: WholeNumber = Field(
        default=2, alias="retryPeriodSeconds", ge=1, le=298, description="How often replicas try the Lease."
    )

    @model_validator(mode="after")
    def _ordered(self) -> Coordination:
        """The CEL rule again, for manifests that reach the handlers without the API server's check."""
        if not self.retry_period_seconds < self.renew_deadline_seconds < self.lease_duration_seconds:
            raise ValueError("coordination needs retryPeriodSeconds < renewDeadlineSeconds < leaseDurationSeconds")
        return self


class ResidentWindow(SpecPart):
    tokens: WholeNumber = Field(
        ge=256,
        le=1 << 20,
        description=(
            "Positions of a slot that a decode step attends over at most: the first sinkTokens, the last recentTokens, "
            "and blocks of 64 chosen between them by a bound of their keys' scores against the slot's last query, "
            "chosen again every 64 steps. Decode then costs about the same at any depth; attention past the window is "
            "an approximation (docs/benchmarks.md has its needle recall). Prefill stays exact, and every block stays "
            "on the GPU: the plan adds about 3% of a q8_0 cache for the keys' bounds."
        ),
    )
    sink_tokens: WholeNumber = Field(
        default=64, alias="sinkTokens", ge=0, le=1 << 16, description="Positions from the start always attended to."
    )
    recent_tokens: WholeNumber = Field(
        default=1024,
        alias="recentTokens",
        ge=64,
        le=1 << 20,
        description="The latest positions always attended to; at least a sliding window's length on Gemma models.",
    )

    @model_validator(mode="after")
    def _leaves_a_choice(self) -> ResidentWindow:
        self.budget().split()
        return self

    def budget(self) -> ResidentBudget:
        return ResidentBudget(tokens=self.tokens, sink_tokens=self.sink_tokens, recent_tokens=self.recent_tokens)


class KVCache(SpecPart):
    resident_window: ResidentWindow | None = Field(
        default=None,
        alias="residentWindow",
        description=(
            "Decode attends over a window of each slot's positions instead of all of them: for long contexts where "
            "speed matters more than exact attention. Unset: every position, exact."
        ),
    )
    host_memory: Quantity | None = Field(
        default=None,
        alias="hostMemory",
        description=(
            "Host memory each stage pod keeps for the KV blocks its GPU lets go of (prefix snapshots evicted from the "
            "device), restored on a prefix hit instead of computed again; the stage pod's memory request (and its "
            "memory limit, when one is set) grows by it. Unset: none."
        ),
    )


class Stage(SpecPart):
    image: str | None = Field(default=None, max_length=512, description="Defaults to the operator's image.")
    resources: Resources = Field(
        default_factory=Resources, description="Stage container resources; the GPU limit comes from the plan."
    )


class ModelDeploymentSpec(SpecPart):
    model_config = ConfigDict(
        extra="forbid",
        populate_by_name=True,
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(self.model.tokenSecretRef) || self.model.url.startsWith('https://') "
                    "|| self.model.url.startsWith('hf://')",
                    "model.tokenSecretRef applies to https:// and hf:// sources only: a token never goes over plain "
                    "http:// or to a file://",
                    ".model.tokenSecretRef",
                ),
                cel(
                    "!has(self.context) || self.context % 256 == 0",
                    "context must be a multiple of 256: the planner sizes KV pools in steps of 256 cells",
                    ".context",
                ),
                cel(
                    "!has(self.context) || self.context >= self.parallel * 256",
                    "context must leave every parallel slot at least 256 cells (context >= parallel * 256)",
                    ".context",
                ),
            ]
        },
    )

    model: ModelSource = Field(description="Where the GGUF file is.")
    served_model_name: str | None = Field(
        default=None, alias="servedModelName", min_length=1, max_length=256, description="Model id clients send."
    )
    replicas: int = Field(
        default=1,
        ge=0,
        le=64,
        description=(
            "Pipelines, each on its own GPUs (kubectl scale sets it; so does spec.autoscaling). The gateway drives "
            "every serving pipeline and routes each request to the one that holds its prompt's prefix. With 0 no "
            "stage pod runs and the gateway stays up."
        ),
    )
    autoscaling: Autoscaling | None = Field(
        default=None, description="Scale the pipelines on the gateway's queue, down to zero if minReplicas is 0."
    )
    rollout: Rollout = Field(default_factory=Rollout, description="How a re-plan replaces the pipelines.")
    context: int | None = Field(default=None, ge=512, le=16_777_216, description="Context length override.")
    parallel: int = Field(default=4, ge=1, le=256, description="Parallel slots sharing one KV pool.")
    cache_type_k: CacheType = Field(default=CacheType.Q8_0, alias="cacheTypeK", description="K cache element type.")
    cache_type_v: CacheType = Field(default=CacheType.Q8_0, alias="cacheTypeV", description="V cache element type.")
    kv_cache: KVCache = Field(default_factory=KVCache, alias="kvCache", description="Where KV blocks are kept.")
    placement: Placement = Field(default_factory=Placement, description="Which nodes and GPUs may take stages.")
    admission: Admission = Field(default_factory=Admission, description="The gateway's bounded queue.")
    gateway: Gateway = Field(default_factory=Gateway, description="The OpenAI-compatible gateway.")
    stage: Stage = Field(default_factory=Stage, description="The stage pods.")
    network_policy: NetworkPolicy = Field(
        default_factory=NetworkPolicy, alias="networkPolicy", description="NetworkPolicies around the pipeline."
    )
    coordination: Coordination = Field(
        default_factory=Coordination, description="The Lease the gateway replicas elect a coordinator on."
    )
    speculative: Speculative | None = Field(default=None, description="Speculative decoding; off if unset.")

    @classmethod
    def from_manifest(cls, spec: dict[str, Any]) -> ModelDeploymentSpec:
        return cls.model_validate(spec)
