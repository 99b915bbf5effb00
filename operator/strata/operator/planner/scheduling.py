"""Whether the scheduler could place a stage pod on a node: readiness, cordon, taints and the node selector.

The planner must not propose a node the scheduler would refuse, so these follow Kubernetes' own rules: a taint
repels a pod unless one of its tolerations matches (operator Exists or Equal, an empty effect matching every
effect), and only NoSchedule and NoExecute taints keep a new pod off a node; PreferNoSchedule is a preference.
Each check returns a reason string (or None) so the inventory can tell a person what to change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from strata.operator.planner.errors import InvalidInventoryError

REPELLING_EFFECTS = frozenset({"NoSchedule", "NoExecute"})


@dataclass(frozen=True)
class Toleration:
    """A pod toleration as the API writes it (camelCase keys); operator defaults to Equal."""

    key: str = ""
    operator: str = "Equal"
    value: str = ""
    effect: str = ""

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Toleration:
        operator = str(raw.get("operator") or "Equal")
        if operator not in ("Equal", "Exists"):
            raise InvalidInventoryError(f"toleration operator must be Equal or Exists, not {operator!r}")
        return cls(
            key=str(raw.get("key") or ""),
            operator=operator,
            value=str(raw.get("value") or ""),
            effect=str(raw.get("effect") or ""),
        )

    def tolerates(self, taint: Mapping[str, Any]) -> bool:
        """Kubernetes' ToleratesTaint: effect, then key (empty key with Exists matches all), then value."""
        if self.effect and self.effect != taint.get("effect"):
            return False
        if self.key and self.key != taint.get("key"):
            return False
        if self.operator == "Exists":
            return True
        return self.value == str(taint.get("value") or "")


def not_ready_reason(node: Mapping[str, Any]) -> str | None:
    """A Ready condition other than True. A node with no conditions at all (a manifest not yet reported on by a
    kubelet) is not held against it: the scheduler itself goes by the not-ready taint the node controller adds."""
    for condition in node.get("status", {}).get("conditions") or ():
        if condition.get("type") == "Ready" and condition.get("status") != "True":
            detail = condition.get("message") or condition.get("reason") or f"Ready={condition.get('status')}"
            return f"NotReady: {detail}"
    return None


def cordoned_reason(node: Mapping[str, Any]) -> str | None:
    if node.get("spec", {}).get("unschedulable"):
        return "cordoned (spec.unschedulable); uncordon it with kubectl uncordon"
    return None


def untolerated_taint_reason(node: Mapping[str, Any], tolerations: Sequence[Toleration]) -> str | None:
    """The first NoSchedule/NoExecute taint that no toleration matches, named as key=value:effect."""
    for taint in node.get("spec", {}).get("taints") or ():
        if taint.get("effect") not in REPELLING_EFFECTS:
            continue
        if not any(toleration.tolerates(taint) for toleration in tolerations):
            value = f"={taint['value']}" if taint.get("value") else ""
            return f"taint {taint.get('key')}{value}:{taint.get('effect')} is not tolerated; add a toleration for it"
    return None


def selector_mismatch_reason(labels: Mapping[str, str], selector: Mapping[str, str]) -> str | None:
    """The first nodeSelector label the node lacks or holds with another value."""
    for key, wanted in sorted(selector.items()):
        actual = labels.get(key)
        if actual != wanted:
            found = "missing" if actual is None else f"is {actual!r}"
            return f"selector mismatch: label {key}={wanted} wanted, {found}"
    return None
