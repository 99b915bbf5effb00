"""Admission: a free lane at once, else a bounded wait, else 429 — never an unbounded queue in front of the GPUs.

Lanes are the plan's parallel slots; a lane is held from admission until its slot has been reset on the stages. With
every lane busy a request may wait in a queue of `queue_per_lane * lanes` places for at most `max_wait_s`; a full
queue or an expired wait is RateLimitedError carrying Retry-After. A released lane goes straight to the oldest
waiter, so nobody overtakes the queue. A request for n choices takes n lanes at once or waits for all n: the oldest
waiter collects lanes as they come free and is admitted when it has its count (a wait that expires gives back what
it collected). All of it runs on the event loop: no locks, and no sleeping.

With several pipelines (strata.gateway.pipelines) the lanes are the sum of the serving pipelines' slots, and that sum
moves as pipelines come, go and fail: `resize` follows it. A lane here is a claim on capacity, not a slot; the
router picks the slot. Lanes taken away while held are owed: they vanish as they are released, so what is held never
exceeds what serves for longer than the lost pipeline takes to fail its requests (it does that at once).
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


@dataclass(eq=False)
class _Waiter:
    count: int
    future: asyncio.Future[None]
    lanes: list[int]


class Admission:
    def __init__(self, policy: AdmissionPolicy, *, metrics: GatewayMetrics) -> None:
        self.policy = policy
        self._metrics = metrics
        self._lanes = policy.lanes
        self._free: deque[int] = deque(range(policy.lanes))
        self._next_lane = policy.lanes  # lanes added later take new numbers, so an owed one is never handed out
        self._owed = 0  # held lanes beyond the capacity: dropped as they are released
        self._waiters: deque[_Waiter] = deque()
        self._update()

    @property
    def lanes(self) -> int:
        """The lanes there are now: the policy's, or what `resize` last set."""
        return self._lanes

    @property
    def busy(self) -> int:
        return self._lanes + self._owed - len(self._free)

    def resize(self, lanes: int) -> None:
        """Make `lanes` the capacity: new lanes go to the oldest waiters first; lanes taken away come out of the free
        ones first, and the rest are owed by the requests that hold them."""
        if lanes < 0:
            raise ValueError(f"lanes must not be negative, not {lanes}")
        change, self._lanes = lanes - self._lanes, lanes
        for _ in range(change):
            self._next_lane += 1
            self.release(self._next_lane - 1)
        for _ in range(-change):
            if self._free:
                self._free.pop()
            else:
                self._owed += 1
        self._update()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> int:
        """A lane index; raises RateLimitedError when the queue is full or the wait expires."""
        return (await self.acquire_lanes(1))[0]

    async def acquire_lanes(self, count: int) -> list[int]:
        """`count` lane indices, all at once (1 <= count <= lanes); RateLimitedError as for one."""
        if not 1 <= count <= max(self._lanes, 1):
            raise ValueError(f"a request takes 1 to {self._lanes} lanes, not {count}")
        if len(self._free) >= count and not self._waiters:
            return self._admit([self._free.popleft() for _ in range(count)])
        if len(self._waiters) >= self._lanes * self.policy.queue_per_lane:
            self._reject("queue_full")
            raise RateLimitedError(
                f"all {self._lanes} lanes are busy and {len(self._waiters)} requests are already waiting; "
                "retry shortly",
                retry_after_s=self.policy.retry_after_s,
            )
        waiter = _Waiter(count=count, future=asyncio.get_running_loop().create_future(), lanes=[])
        self._waiters.append(waiter)
        while self._free and len(waiter.lanes) < count and self._waiters[0] is waiter:
            waiter.lanes.append(self._free.popleft())  # free lanes a waiter ahead did not need
        self._update()
        try:
            if len(waiter.lanes) < count:
                await asyncio.wait({waiter.future}, timeout=self.policy.max_wait_s)
        except asyncio.CancelledError:  # the client went away while waiting: lanes handed over meanwhile go back
            self._withdraw(waiter, give_back=True)
            raise
        lanes = self._withdraw(waiter, give_back=False)
        if lanes is None:
            self._reject("wait_expired")
            raise RateLimitedError(
                f"no lane came free within {self.policy.max_wait_s:g} s; retry shortly",
                retry_after_s=self.policy.retry_after_s,
            )
        return self._admit(lanes)

    def release(self, lane: int) -> None:
        """Hand `lane` to the oldest live waiter, or back to the free list; an owed lane is dropped."""
        if self._owed:
            self._owed -= 1
            self._update()
            return
        while self._waiters:
            waiter = self._waiters[0]
            if waiter.future.done():  # expired or cancelled: its own task withdraws it and passes its lanes on
                self._waiters.popleft()
                continue
            waiter.lanes.append(lane)
            if len(waiter.lanes) == waiter.count:
                self._waiters.popleft()
                waiter.future.set_result(None)
            self._update()
            return
        self._free.append(lane)
        self._update()

    def _withdraw(self, waiter: _Waiter, *, give_back: bool) -> list[int] | None:
        """Take `waiter` out of the queue: its lanes when it has them all and may keep them, else None (any lanes it
        collected go to the next waiters)."""
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)
        complete = len(waiter.lanes) == waiter.count
        if not waiter.future.done():
            waiter.future.cancel()
        lanes, waiter.lanes = waiter.lanes, []
        self._update()
        if complete and not give_back:
            return lanes
        for lane in lanes:
            self.release(lane)
        return None

    def _admit(self, lanes: list[int]) -> list[int]:
        self._metrics.admitted.inc()
        self._update()
        return lanes

    def _reject(self, reason: str) -> None:
        self._metrics.rejected.labels(reason=reason).inc()

    def _update(self) -> None:
        self._metrics.lanes_busy.set(self.busy)
        self._metrics.queue_depth.set(len(self._waiters))
