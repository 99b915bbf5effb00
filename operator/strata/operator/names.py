"""Names and labels of every object the operator creates, in one place.

Kubernetes names of Services, StatefulSet pods' hostnames and label values are limited to 63 characters; a long
ModelDeployment name is cut and given a short hash so two long names never collide.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

MAX_NAME = 63
STAGE_PORT = 50051
GATEWAY_PORT = 8000
CLUSTER_DOMAIN = "cluster.local"

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_GENERATION = "strata.dev/plan-generation"
LABEL_STAGE = "strata.dev/stage"
# Which pipeline (replica) of the deployment a stage pod belongs to; generations are unique across pipelines.
LABEL_PIPELINE = "strata.dev/pipeline"
FIELD_MANAGER = "strata-operator"
# The namespace label the API server sets on every namespace, so a NetworkPolicy can select one by name.
LABEL_NAMESPACE_NAME = "kubernetes.io/metadata.name"


def fit(name: str, *, suffix: str = "", limit: int = MAX_NAME) -> str:
    """`name` + `suffix` within `limit` characters; when cut, a hash of the full name keeps it unique."""
    full = f"{name}{suffix}"
    if len(full) <= limit:
        return full
    digest = hashlib.sha256(full.encode()).hexdigest()[:8]
    keep = limit - len(suffix) - len(digest) - 1
    return f"{name[:keep].rstrip('-.')}-{digest}{suffix}"


@dataclass(frozen=True)
class Names:
    """Every child name of one ModelDeployment."""

    deployment: str
    namespace: str

    @property
    def plan_configmap(self) -> str:
        return fit(self.deployment, suffix="-plan")

    @property
    def pipelines_configmap(self) -> str:
        """The serving pipelines, each with its first stage's address and lanes (pipelines.json)."""
        return fit(self.deployment, suffix="-pipelines")

    @property
    def stages_service(self) -> str:
        return fit(self.deployment, suffix="-stages")

    @property
    def gateway(self) -> str:
        return fit(self.deployment, suffix="-gateway")

    @property
    def gateway_account(self) -> str:
        """The gateway's ServiceAccount, and the Role and RoleBinding that let it hold its Lease."""
        return fit(self.deployment, suffix="-gateway")

    @property
    def coordinator_lease(self) -> str:
        return fit(self.deployment, suffix="-coordinator")

    @property
    def stages_pdb(self) -> str:
        return fit(self.deployment, suffix="-stages")

    def stage_policy(self, *, index: int) -> str:
        """The NetworkPolicy of stage `index`, shared by every plan generation (it selects by stage index)."""
        return fit(self.deployment, suffix=f"-s{index}")

    def stage(self, *, generation: int, index: int) -> str:
        # The pod's hostname is `<statefulset>-0`: keep two characters for that suffix.
        return fit(self.deployment, suffix=f"-g{generation}-s{index}", limit=MAX_NAME - 2)

    def stage_address(self, *, generation: int, index: int) -> str:
        """host:port of a stage pod, through the headless Service's per-pod DNS record."""
        pod = f"{self.stage(generation=generation, index=index)}-0"
        return f"{pod}.{self.stages_service}.{self.namespace}.svc.{CLUSTER_DOMAIN}:{STAGE_PORT}"

    def gateway_url(self) -> str:
        return f"http://{self.gateway}.{self.namespace}.svc.{CLUSTER_DOMAIN}:{GATEWAY_PORT}/v1"


def labels(deployment: str, *, component: str) -> dict[str, str]:
    return {
        LABEL_NAME: "strata",
        LABEL_INSTANCE: fit(deployment),
        LABEL_COMPONENT: component,
        LABEL_MANAGED_BY: FIELD_MANAGER,
    }


def operator_labels() -> dict[str, str]:
    """The labels the chart puts on the operator's pods that say what they are (not which release)."""
    return {LABEL_NAME: "strata", LABEL_COMPONENT: "operator"}


def stage_labels(deployment: str, *, generation: int, index: int, pipeline: int = 0) -> dict[str, str]:
    return labels(deployment, component="stage") | {
        LABEL_GENERATION: str(generation),
        LABEL_STAGE: str(index),
        LABEL_PIPELINE: str(pipeline),
    }


def stage_selector(deployment: str) -> str:
    """Every stage pod of the deployment as a label selector string (the scale subresource's status.selector)."""
    return ",".join(f"{key}={value}" for key, value in labels(deployment, component="stage").items())
