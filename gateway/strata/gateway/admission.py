"""Admission: a free lane at once, else a bounded wait, else 429 — never an unbounded queue in front of the GPUs.

Lanes are the plan's parallel slots; a lane is held from admission until its slot has been reset on the stages. With
every lane busy a request may wait in a queue of `queue_per_lane * lanes` places for at most `max_wait_s`; a full
queue or an expired wait is RateLimitedError carrying Retry-After. A released lane goes straight to the oldest
waiter, so nobody overtakes the queue. All of it runs on the event loop: no locks, and no sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass

from strata.gateway.errors import RateLimitedError
from strata.gateway.metrics import GatewayMetrics


@dataclass(frozen=True, kw_only=True)
class AdmissionPolicy:
    lanes: int
    queue_per_lane: int = 1
    max_wait_s: float = 10.0
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if self.lanes < 1 or self.queue_per_lane < 0 or self.max_wait_s <= 0 or self.retry_after_s < 1:
            raise ValueError(f"admission needs lanes >= 1, queue >= 0, a positive wait and retry-after: {self}")

    @property
    def queue_limit(self) -> int:
        return self.lanes * self.queue_per_lane


class Admission:
    def __init__(self, policy: AdmissionPolicy, *, metrics: GatewayMetrics) -> None:
        self.policy = policy
        self._metrics = metrics
        self._free: deque[int] = deque(range(policy.lanes))
        self._waiters: deque[asyncio.Future[int]] = deque()
        self._update()

    @property
    def busy(self) -> int:
        return self.policy.lanes - len(self._free)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> int:
        """A lane index; raises RateLimitedError when the queue is full or the wait expires."""
        if self._free and not self._waiters:
            return self._admit(self._free.popleft())
        if len(self._waiters) >= self.policy.queue_limit:
            self._reject("queue_full")
            raise RateLimitedError(
                f"all {self.policy.lanes} lanes are busy and {len(self._waiters)} requests are already waiting; "
                "retry shortly",
                retry_after_s=self.policy.retry_after_s,
            )
        waiter: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._update()
        try:
            await asyncio.wait({waiter}, timeout=self.policy.max_wait_s)
        except asyncio.CancelledError:  # the client went away while waiting: a lane handed over meanwhile goes back
            self._withdraw(waiter, give_back=True)
            raise
        lane = self._withdraw(waiter, give_back=False)
        if lane is None:
            self._reject("wait_expired")
            raise RateLimitedError(
                f"no lane came free within {self.policy.max_wait_s:g} s; retry shortly",
                retry_after_s=self.policy.retry_after_s,
            )
        return self._admit(lane)

    def release(self, lane: int) -> None:
        """Hand `lane` to the oldest live waiter, or back to the free list."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(lane)
                self._update()
                return
        self._free.append(lane)
        self._update()

    def _withdraw(self, waiter: asyncio.Future[int], *, give_back: bool) -> int | None:
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)
        lane = waiter.result() if waiter.done() and not waiter.cancelled() else None
        waiter.cancel()
        self._update()
        if give_back and lane is not None:
            self.release(lane)
            return None
        return lane

    def _admit(self, lane: int) -> int:
        self._metrics.admitted.inc()
        self._update()
        return lane

    def _reject(self, reason: str) -> None:
        self._metrics.rejected.labels(reason=reason).inc()

    def _update(self) -> None:
        self._metrics.lanes_busy.set(self.busy)
        self._metrics.queue_depth.set(len(self._waiters))
