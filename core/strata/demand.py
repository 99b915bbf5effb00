"""The demand a gateway sees, as it tells the operator: one annotation on the coordinator Lease.

The operator scales a deployment's pipelines on what its gateway observes (requests waiting for a lane, lanes busy,
requests held while no pipeline serves). The coordinator gateway writes it into an annotation of the Lease it
already renews every retry period, so the signal costs:

- no new verb or object in the gateway's Role: it holds `update` on that one Lease, narrowed by name, to renew it.
  Patching its own ModelDeployment instead would need `patch` on the whole object, spec included, for a pod that
  faces clients; scraping the gateway's metrics would need the operator to reach every gateway pod through the
  NetworkPolicies and to pick the coordinator among them;
- no new read for the operator: it watches the coordinator Leases already (to report the holder), and its projection
  keeps this annotation, so a change in demand wakes the deployment's monitor at once, even at zero pipelines.

Only the coordinator writes it, and only the coordinator serves (the standbys are not ready), so it sees every
request. The figures are counts, with no timestamp: a renewal that changes nothing leaves the annotation as it was,
and so does not wake the operator every retry period.

Both sides read the one format here: the gateway may not import the operator.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

DEMAND_ANNOTATION = "strata.dev/demand"
_MAX_CHARS = 256  # a well-formed annotation is far shorter; anything longer is not ours


class DemandUnreadable(ValueError):
    """The annotation is not the shape this operator reads; the message says what is wrong."""


@dataclass(frozen=True, kw_only=True)
class Demand:
    lanes: int  # lanes of the pipelines that serve now
    busy: int  # lanes held by requests
    queue: int  # requests waiting for a lane
    held: int  # requests held because no pipeline serves (at zero, or while every pipeline is down)

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise DemandUnreadable(f"demand.{name} must be a non-negative integer, not {value!r}")

    def encode(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def decode(cls, text: str) -> Demand:
        if len(text) > _MAX_CHARS:
            raise DemandUnreadable(f"the {DEMAND_ANNOTATION} annotation is {len(text)} characters, over {_MAX_CHARS}")
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as e:
            raise DemandUnreadable(f"the {DEMAND_ANNOTATION} annotation is not JSON: {e}") from e
        if not isinstance(fields, dict):
            raise DemandUnreadable(f"the {DEMAND_ANNOTATION} annotation must be a JSON object")
        known = {"lanes", "busy", "queue", "held"}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise DemandUnreadable(f"the {DEMAND_ANNOTATION} annotation has unknown fields {unknown}")
        missing = sorted(known - set(fields))
        if missing:
            raise DemandUnreadable(f"the {DEMAND_ANNOTATION} annotation lacks {missing}")
        return cls(**fields)
