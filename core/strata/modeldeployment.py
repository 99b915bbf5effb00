"""The ModelDeployment's API identity, the Event reason recorded on it from outside the operator, and the address
of a pipeline's first stage.

The operator defines the resource; the gateway records an Event about it (a stage refusing the gateway's coordinator
term), follows the pipelines its status says serve and dials each one's first stage, and may not import the
operator, so the names both need live here, once.
"""

from __future__ import annotations

import hashlib

GROUP = "strata.dev"
VERSION = "v1alpha1"
KIND = "ModelDeployment"
PLURAL = "modeldeployments"
API_VERSION = f"{GROUP}/{VERSION}"

# The Warning a gateway records when a stage refuses its coordinator term (FAILED_PRECONDITION).
COORDINATOR_FENCED = "CoordinatorFenced"

MAX_NAME = 63
STAGE_PORT = 50051
CLUSTER_DOMAIN = "cluster.local"


def fit(name: str, *, suffix: str = "", limit: int = MAX_NAME) -> str:
    """`name` + `suffix` within `limit` characters; when cut, a hash of the full name keeps it unique."""
    full = f"{name}{suffix}"
    if len(full) <= limit:
        return full
    digest = hashlib.sha256(full.encode()).hexdigest()[:8]
    keep = limit - len(suffix) - len(digest) - 1
    return f"{name[:keep].rstrip('-.')}-{digest}{suffix}"


def stage_name(deployment: str, *, generation: int, index: int) -> str:
    """The StatefulSet of stage `index` of plan generation `generation`."""
    # The pod's hostname is `<statefulset>-0`: keep two characters for that suffix.
    return fit(deployment, suffix=f"-g{generation}-s{index}", limit=MAX_NAME - 2)


def stages_service(deployment: str) -> str:
    """The headless Service every stage pod of the deployment is named under."""
    return fit(deployment, suffix="-stages")


def stage_address(deployment: str, namespace: str, *, generation: int, index: int) -> str:
    """host:port of a stage pod, through the headless Service's per-pod DNS record."""
    pod = f"{stage_name(deployment, generation=generation, index=index)}-0"
    return f"{pod}.{stages_service(deployment)}.{namespace}.svc.{CLUSTER_DOMAIN}:{STAGE_PORT}"
