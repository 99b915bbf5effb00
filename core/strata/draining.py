"""How long a pipeline that stops serving lives on: the gateway's drain, and the bound the operator keeps its stages.

A pipeline leaves the gateway's list when the operator removes it (spec.replicas lowered) or moves it to a new
generation. The gateway reads the list from the deployment's status once every poll period, takes the pipeline out
of routing at that read, and gives what still runs there the drain (spec.rollout.drainSeconds; `DRAIN_S` unless
set) to finish before failing the rest with a retryable 503 (strata.gateway.pipelines). The operator keeps the
leaving generation's stages until the gateway is done with them for certain: one poll period and one read's timeout
for the gateway to see the change, the drain, and a margin for the two processes' clocks and schedules
(strata.operator.retirement). After that bound nothing the gateway runs can be on those stages, whatever they do, so
deleting them fails no request.

Both sides read the numbers here: the gateway may not import the operator.
"""

from __future__ import annotations

# What a pipeline that left the gateway's list has to finish its requests before they fail, unless the deployment
# says otherwise: long enough for a completion of a few hundred tokens on a loaded pipeline.
DRAIN_S = 30.0
LIST_READ_TIMEOUT_S = 5.0  # one read of the deployment's status by the gateway gives up after this
MARGIN_S = 3.0  # clocks and schedulers of the operator and the gateway


def retire_after_s(*, poll_s: float, drain_s: float = DRAIN_S) -> float:
    """Seconds from the status that drops a pipeline to the moment no gateway can still run a request on it, for a
    gateway that reads the status every `poll_s` seconds and drains for `drain_s`."""
    if poll_s <= 0 or drain_s <= 0:
        raise ValueError(f"the gateway's poll period ({poll_s} s) and drain ({drain_s} s) must be positive")
    return poll_s + LIST_READ_TIMEOUT_S + drain_s + MARGIN_S
