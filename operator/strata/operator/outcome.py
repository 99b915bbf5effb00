"""What reconciling one ModelDeployment produces: its status, the Events to record, and when to read the model
again; and the error for a spec that can never apply."""

from __future__ import annotations

from dataclasses import dataclass, field

from strata.operator.status import ModelDeploymentStatus


class InvalidSpec(Exception):
    """The spec passed the API server but not the handlers' model: retrying will not help."""


@dataclass(frozen=True)
class Event:
    type: str  # Normal or Warning
    reason: str  # an EventReason, or the Planned condition's Reason when the spec cannot be applied
    message: str


@dataclass
class Outcome:
    status: ModelDeploymentStatus
    events: list[Event] = field(default_factory=list)
    retry_in: float | None = None  # seconds until the model is read again, while it cannot be read
