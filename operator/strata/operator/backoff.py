"""When to read a model again that could not be read: a delay that doubles from seconds to a cap of minutes.

A URL that 404s or a host that refuses connections may be fixed without a spec change (a file uploaded, a server back
up, a Secret created), so the operator tries again; but a deployment that stays broken must not cost an HTTP request
and an Event every few seconds forever. The state is in memory, per deployment and spec generation: a new generation
starts again from the first delay, and so does a restarted operator (a restart is a moment to look again).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

FIRST_DELAY_SECONDS = 2.0
MAX_DELAY_SECONDS = 300.0


def retry_delay(failures: int, *, first: float = FIRST_DELAY_SECONDS, cap: float = MAX_DELAY_SECONDS) -> float:
    """The delay after `failures` failed attempts in a row (1 is the first failure)."""
    return min(cap, first * 2.0 ** min(max(failures - 1, 0), 64))


@dataclass(frozen=True)
class _Attempts:
    generation: int
    failures: int
    due: float


class Backoff:
    """Failed attempts per deployment uid; `due` says when the next one should run. Thread-safe: kopf runs the
    change handlers of a deployment in one thread and its monitor's passes in another."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._attempts: dict[str, _Attempts] = {}

    def failed(self, uid: str, *, generation: int) -> float:
        """Record a failed attempt for spec `generation`; returns the delay before the next one."""
        with self._lock:
            before = self._attempts.get(uid)
            failures = before.failures + 1 if before is not None and before.generation == generation else 1
            delay = retry_delay(failures)
            self._attempts[uid] = _Attempts(generation=generation, failures=failures, due=self._clock() + delay)
            return delay

    def succeeded(self, uid: str) -> None:
        with self._lock:
            self._attempts.pop(uid, None)

    def remaining(self, uid: str) -> float | None:
        """Seconds until the next attempt is due (0 once it is), None while no failed attempt waits for one."""
        with self._lock:
            attempts = self._attempts.get(uid)
            return None if attempts is None else max(0.0, attempts.due - self._clock())

    def due(self, uid: str) -> bool:
        """A failed attempt waits for its retry and the delay has passed."""
        with self._lock:
            attempts = self._attempts.get(uid)
            return attempts is not None and self._clock() >= attempts.due
