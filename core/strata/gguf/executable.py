"""Which models Strata's stages can run: one answer for `strata inspect`, `strata serve` and the operator's planning.

A model of another architecture reads and plans like any other (its header says what it would take), but every stage
would fail to load it. So the places that decide to run a model ask here first and refuse with this reason, instead
of starting stages that load nothing: `strata serve` exits before starting any, the operator sets `Planned=False`,
and `strata inspect` says so. The stage worker's loader (strata.stage_worker.loader) raises the same reason, and a
test keeps its table of architectures equal to this set. The set is the architecture table's
(strata.gguf.architectures): an architecture runs exactly when the table describes it. A file of such an
architecture may still ask for something the stages do not apply (a RoPE scaling, strata.gguf.rope_scaling): the
header's description carries that as `unsupported`, and the same checks refuse it.
"""

from __future__ import annotations

from strata.gguf.architectures import ARCHITECTURES

EXECUTABLE_ARCHITECTURES = frozenset(ARCHITECTURES)


class NotExecutableError(ValueError):
    """The model is of an architecture Strata's stage worker does not run; the message says which ones it runs."""


def not_executable_reason(architecture: str, *, unsupported: str | None = None) -> str | None:
    """Why Strata's stages cannot run a model of `architecture` whose file asks for `unsupported` (what
    ModelInfo.unsupported says), or None when they can."""
    if architecture not in EXECUTABLE_ARCHITECTURES:
        runs = ", ".join(sorted(EXECUTABLE_ARCHITECTURES))
        return f"architecture {architecture!r} is not one the stage worker runs ({runs})"
    return unsupported


def check_executable(architecture: str, *, unsupported: str | None = None) -> None:
    """Raise NotExecutableError unless Strata's stages run this model."""
    reason = not_executable_reason(architecture, unsupported=unsupported)
    if reason is not None:
        raise NotExecutableError(reason)
