"""Which pipelines may start a new plan generation now: a re-plan replaces pipelines a few at a time (pure).

A pipeline that is replaced keeps serving on its old generation while the new one loads beside it, and moves over
only once every new stage is ready (Reconciler.advance). The bound here limits how many serving pipelines are in
that state at once, so a spec change to a deployment of several pipelines rolls through them in index order rather
than reloading them all together; with two or more replicas at least one pipeline is never touched, so a rollout
that goes wrong (a generation that never loads) leaves it serving as it was.

A pipeline that serves nothing (new, lost, or never ready) is replaced at once: that costs no capacity.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineState:
    index: int
    serves: bool  # its serving generation's stages are all ready
    replacing: bool  # a newer generation than the serving one is loading
    wants_new: bool  # the planner's placement for it differs from its newest generation


def replacement_budget(*, replicas: int, max_unavailable: int) -> int:
    """How many serving pipelines may be replaced at once: never all of them when there are two or more."""
    if replicas <= 1:
        return 1  # one pipeline: its new generation loads beside the old one, which serves until the cutover
    return max(1, min(max_unavailable, replicas - 1))


def admitted(states: Sequence[PipelineState], *, budget: int) -> set[int]:
    """Indices of the pipelines that may start a new generation now.

    Those already being replaced may move on to a newer placement (the generation they load serves nothing yet);
    the serving ones wait for a free place in the budget, lowest index first.
    """
    busy = sum(1 for s in states if s.serves and s.replacing)
    allowed = set()
    for state in sorted(states, key=lambda s: s.index):
        if not state.wants_new:
            continue
        if not state.serves or state.replacing:
            allowed.add(state.index)
        elif busy < budget:
            allowed.add(state.index)
            busy += 1
    return allowed
