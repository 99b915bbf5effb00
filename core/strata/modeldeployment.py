"""The ModelDeployment's API identity, and the Event reason recorded on it from outside the operator.

The operator defines the resource; the gateway records an Event about it (a stage refusing the gateway's coordinator
term) and may not import the operator, so the names both need live here, once.
"""

from __future__ import annotations

GROUP = "strata.dev"
VERSION = "v1alpha1"
KIND = "ModelDeployment"
PLURAL = "modeldeployments"
API_VERSION = f"{GROUP}/{VERSION}"

# The Warning a gateway records when a stage refuses its coordinator term (FAILED_PRECONDITION).
COORDINATOR_FENCED = "CoordinatorFenced"
