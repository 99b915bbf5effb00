"""Names and labels of every object the operator creates, in one place.

Kubernetes names of Services, StatefulSet pods' hostnames and label values are limited to 63 characters; a long
ModelDeployment name is cut and given a short hash so two long names never collide.
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.modeldeployment import CLUSTER_DOMAIN, stage_address, stage_name, stages_service
from strata.modeldeployment import MAX_NAME as MAX_NAME  # re-exported: the operator's modules name them from here
from strata.modeldeployment import STAGE_PORT as STAGE_PORT
from strata.modeldeployment import fit as fit

GATEWAY_PORT = 8000

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
        return stages_service(self.deployment)

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
        return stage_name(self.deployment, generation=generation, index=index)

    def stage_address(self, *, generation: int, index: int) -> str:
        """host:port of a stage pod, through the headless Service's per-pod DNS record."""
        return stage_address(self.deployment, self.namespace, generation=generation, index=index)

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
