"""Which stage sets stay: the generations pipelines use, and the ones the gateway may still drain (pure).

A generation the gateway may be driving (the serving generation of a pipeline listed as ready) leaves the plan when
its pipeline is removed or moves to a new generation. Deleting its StatefulSets then would fail what still runs on
it with a retryable 503, so it retires instead: it is stamped with the time it left, its stages stay while the
gateway drains it, and it goes once `strata.draining.retire_after_s` has passed since. A generation no gateway could
be driving (one that was only loading) goes at once: nothing runs on it, and its GPUs may be wanted.

A time bound, not a report from the gateway that the pipeline is idle: the bound holds without a new signal, and a
report could not say "idle" for a pipeline the gateway has not yet noticed leaving. The deadline is what ends every
wait here: a retired generation goes at its bound whatever the gateway does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, order=True)
class Retiring:
    """A generation that left the plan while the gateway may have been driving it."""

    generation: int
    pipeline: int
    since: float  # seconds since the epoch, when it left


@dataclass(frozen=True, kw_only=True)
class Retirement:
    retiring: tuple[Retiring, ...]  # still draining: their stages stay
    keep: frozenset[int]  # every generation whose stages stay
    due_in: float | None  # seconds until the next retiring generation may go; None when none retires


def retire(
    *,
    listed: Mapping[int, int],
    in_use: Iterable[int],
    retiring: Sequence[Retiring],
    now: float,
    after_s: float,
) -> Retirement:
    """`listed`: generation -> pipeline of what the gateway may have been driving before this change; `in_use`: the
    generations pipelines load or serve after it; `retiring`: what retired earlier."""
    used = frozenset(in_use)
    known = {r.generation for r in retiring}
    left = [Retiring(generation=g, pipeline=p, since=now) for g, p in listed.items() if g not in used | known]
    draining = tuple(sorted(r for r in [*retiring, *left] if r.generation not in used and now < r.since + after_s))
    due = min((r.since + after_s - now for r in draining), default=None)
    return Retirement(retiring=draining, keep=used | {r.generation for r in draining}, due_in=due)
