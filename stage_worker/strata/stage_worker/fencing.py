"""Coordinator fencing: a stage accepts the highest term it has seen and refuses anything older.

A coordinator that lost its Lease keeps its old term; the new one holds a higher term. Refusing the lower term (and
the same term from a different holder or Lease) keeps two coordinators from driving one pipeline at once.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from strata.stage_worker.errors import StaleTermError


@dataclass(frozen=True)
class Holder:
    term: int
    holder: str
    lease_uid: str


class TermFence:
    """The fence of stage `stage`. Its refusals name the stage: they travel back through every earlier stage to
    the coordinator, which reports which stage fenced it."""

    def __init__(self, *, stage: int) -> None:
        self.stage = stage
        self._lock = threading.Lock()
        self._accepted = Holder(term=0, holder="", lease_uid="")

    @property
    def accepted_term(self) -> int:
        return self._accepted.term

    def admit(self, caller: Holder) -> bool:
        """Accept `caller` if its term is newer, or the same term from the same holder; raise otherwise.

        True when `caller` is a new holder (a newer term): what the stage kept for the previous one must go.
        """
        with self._lock:
            current = self._accepted
            if caller.term < 1:
                raise StaleTermError(
                    f"stage {self.stage}: the call carries no coordinator term (holder {caller.holder!r}); "
                    "terms start at 1"
                )
            if caller.term < current.term:
                raise StaleTermError(
                    f"stage {self.stage}: term {caller.term} (holder {caller.holder!r}) is older than the accepted "
                    f"term {current.term} (holder {current.holder!r})"
                )
            if caller.term == current.term and (caller.holder, caller.lease_uid) != (current.holder, current.lease_uid):
                raise StaleTermError(
                    f"stage {self.stage}: term {caller.term} is held by {current.holder!r} "
                    f"(lease {current.lease_uid!r}); {caller.holder!r} (lease {caller.lease_uid!r}) cannot use it"
                )
            changed = caller != current
            self._accepted = caller
            return changed
