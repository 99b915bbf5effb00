"""The ModelDeployment spec: one typed pydantic model that validates in the handlers and generates the CRD.

Field names are the camelCase the API server stores; constraints that the API server can check (ranges, enums,
patterns, CEL rules for cross-field checks) live here so that `crds/` is generated from them and a bad manifest is
refused at `kubectl apply` time with a field-level message.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.config import JsonDict
from strata.draining import DRAIN_S
from strata.gguf.model import CacheType
from strata.modeldeployment import GROUP as GROUP
from strata.modeldeployment import KIND as KIND
from strata.modeldeployment import PLURAL as PLURAL
from strata.modeldeployment import VERSION as VERSION

# Kubernetes resource quantities ("500m", "16Gi", "2").
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$"
MODEL_URL_PATTERN = r"^(https?://[^/\s]+/|hf://[^/\s]+/[^/\s]+/|file:///)\S*\.gguf(@[^/\s@]+)?$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"

Quantity = Annotated[str, Field(pattern=QUANTITY_PATTERN, max_length=64)]
# A whole number that a CEL rule reads. The API server hands CEL an `integer` field as an int and fails the rule on a
# whole number written with a decimal point (`1.0` arrives as float64: "expected int, got float64"), while it hands
# CEL a `number` field as a double however it was written; multipleOf keeps it whole, and the handlers' int takes 1.0.
WholeNumber = Annotated[int, Field(json_schema_extra={"type": "number", "multipleOf": 1})]


def cel(rule: str, message: str, field_path: str | None = None) -> JsonDict:
    """An x-kubernetes-validations entry: a CEL rule the API server evaluates on apply."""
    entry: JsonDict = {"rule": rule, "message": message}
    if field_path:
        entry["fieldPath"] = field_path
    return entry


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, use_enum_values=False)


class SecretKeyRef(_Spec):
    name: str = Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253, description="Secret in the same namespace.")
    key: str = Field(default="token", min_length=1, max_length=253, description="Key within the Secret.")


class ModelSource(_Spec):
    url: str = Field(
        pattern=MODEL_URL_PATTERN,
        max_length=2048,
        description=(
            "GGUF file: https://HOST/PATH.gguf, hf://ORG/REPO/PATH.gguf[@REVISION], file:///PATH.gguf, or "
            "http://HOST/PATH.gguf for a file server inside the cluster (never with a token)."
        ),
    )
    token_secret_ref: SecretKeyRef | None = Field(
        default=None, alias="tokenSecretRef", description="Bearer token for https:// or hf:// sources."
    )

    @model_validator(mode="after")
    def _token_only_over_tls(self) -> ModelSource:
        """The CEL rule again, for manifests that reach the handlers without the API server's check."""
        if self.token_secret_ref is not None and not self.url.startswith(("https://", "hf://")):
            raise ValueError("model.tokenSecretRef applies to https:// and hf:// sources only")
        return self


class TolerationOperator(StrEnum):
    EXISTS = "Exists"
    EQUAL = "Equal"


class TaintEffect(StrEnum):
    NO_SCHEDULE = "NoSchedule"
    PREFER_NO_SCHEDULE = "PreferNoSchedule"
    NO_EXECUTE = "NoExecute"


class Toleration(_Spec):
    key: str | None = Field(default=None, max_length=316, description="Taint key; empty with Exists matches all.")
    operator: TolerationOperator = Field(default=TolerationOperator.EQUAL, description="As in a Pod's tolerations.")
    value: str | None = Field(default=None, max_length=63, description="Taint value, with Equal.")
    effect: TaintEffect | None = Field(default=None, description="Taint effect to match; empty matches all.")
    toleration_seconds: int | None = Field(
        default=None, alias="tolerationSeconds", ge=0, description="How long a NoExecute taint is tolerated."
    )


class Placement(_Spec):
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


class Admission(_Spec):
    queue_per_lane: int = Field(
        default=1, alias="queuePerLane", ge=0, le=64, description="Requests that may wait per lane when all are busy."
    )
    max_wait_seconds: float = Field(
        default=10.0, alias="maxWaitSeconds", gt=0, le=600, description="Longest wait for a lane before HTTP 429."
    )
    retry_after_seconds: int = Field(
        default=1, alias="retryAfterSeconds", ge=1, le=3600, description="Retry-After sent with HTTP 429."
    )


class Resources(_Spec):
    requests: dict[str, Quantity] = Field(default_factory=dict, description="As in a container's resources.")
    limits: dict[str, Quantity] = Field(default_factory=dict, description="As in a container's resources.")


class Ingress(_Spec):
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


class Gateway(_Spec):
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


class LabelSelector(_Spec):
    match_labels: dict[str, str] = Field(
        default_factory=dict, alias="matchLabels", max_length=32, description="Labels the peers carry."
    )


class MetricsScraper(_Spec):
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


class NetworkPolicy(_Spec):
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


class Coordination(_Spec):
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


class Rollout(_Spec):
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


class Autoscaling(_Spec):
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


class SpeculativeMethod(StrEnum):
    NGRAM = "ngram"
    DRAFT = "draft"


class Speculative(_Spec):
    model_config = ConfigDict(
        extra="forbid",
        populate_by_name=True,
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("self.minDraft <= self.maxDraft", "minDraft must not exceed maxDraft"),
                cel(
                    "self.method == 'draft' ? has(self.draftModel) : !has(self.draftModel)",
                    "draftModel is required with method draft and applies to it only",
                    ".draftModel",
                ),
                cel("!has(self.pMin) || self.method == 'draft'", "pMin applies to method draft only", ".pMin"),
                cel(
                    "!has(self.draftModel) || !has(self.draftModel.tokenSecretRef) "
                    "|| self.draftModel.url.startsWith('https://') || self.draftModel.url.startsWith('hf://')",
                    "draftModel.tokenSecretRef applies to https:// and hf:// sources only, as model.tokenSecretRef",
                    ".draftModel.tokenSecretRef",
                ),
            ]
        },
    )

    method: SpeculativeMethod = Field(
        description=(
            "ngram: the gateway proposes the tokens that followed the latest earlier occurrence of a request's last "
            "tokens in its own prompt and output (code edits, quoted tool results, structured output repeat "
            "themselves); the stages verify them in one step. draft: a small GGUF of the target's vocabulary "
            "(draftModel), run in each gateway pod on its CPU, proposes its greedy continuation. Applies to requests "
            "without a grammar or penalties; the text is the same as without it, sampled text included."
        )
    )
    draft_model: ModelSource | None = Field(
        default=None,
        alias="draftModel",
        description=(
            "The draft GGUF of method draft, given as spec.model is; its vocabulary must be the model's (the gateway "
            "refuses another at start-up, naming both files). The operator reads its header: the gateway pod's "
            "default memory request grows by the draft's weights (float32 on the CPU, quantised blocks kept) and its "
            "KV at the plan's context and lanes; a memory request set in gateway.resources is taken as given."
        ),
    )
    p_min: float | None = Field(
        default=None,
        alias="pMin",
        ge=0.0,
        le=1.0,
        description=(
            "Method draft: a proposal stops before the draft's first pick less likely than this (default 0.3: such a "
            "pick is more often wrong than right, and every draft token after a wrong one is wasted)."
        ),
    )
    max_draft: WholeNumber = Field(
        default=4, alias="maxDraft", ge=1, le=16, description="Tokens proposed a step, at most."
    )
    min_draft: WholeNumber = Field(
        default=1, alias="minDraft", ge=1, le=16, description="Shorter proposals are not sent."
    )
    position_cost: float | None = Field(
        default=None,
        alias="positionCost",
        ge=0.0,
        le=1.0,
        description=(
            "What one more position adds to a decode step's time, in one-position steps (default 0.1). Each step's "
            "drafts are as long as pays by it and the lanes' recent acceptance, and none while the batch is too full "
            "for drafts to pay; bench/speculative.py measures it on the GPUs that serve."
        ),
    )

    @model_validator(mode="after")
    def _draft_bounds(self) -> Speculative:
        """The CEL rule again, for manifests that reach the handlers without the API server's check."""
        if self.min_draft > self.max_draft:
            raise ValueError("speculative needs minDraft <= maxDraft")
        drafting = self.method is SpeculativeMethod.DRAFT
        if drafting != (self.draft_model is not None):
            raise ValueError("speculative draftModel is required with method draft and applies to it only")
        if self.p_min is not None and not drafting:
            raise ValueError("speculative pMin applies to method draft only")
        return self


class KVCache(_Spec):
    host_memory: Quantity | None = Field(
        default=None,
        alias="hostMemory",
        description=(
            "Host memory each stage pod keeps for the KV blocks its GPU lets go of (prefix snapshots evicted from the "
            "device), restored on a prefix hit instead of computed again; the stage pod's memory request (and its "
            "memory limit, when one is set) grows by it. Unset: none."
        ),
    )


class Stage(_Spec):
    image: str | None = Field(default=None, max_length=512, description="Defaults to the operator's image.")
    resources: Resources = Field(
        default_factory=Resources, description="Stage container resources; the GPU limit comes from the plan."
    )


class ModelDeploymentSpec(_Spec):
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
