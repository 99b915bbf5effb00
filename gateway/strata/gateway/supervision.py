"""`strata serve` keeps its stages running, as a StatefulSet's controller and the kubelet do in a cluster.

A stage process that dies (killed, out of memory, crashed) is started again on the port it had, so the addresses the
stages chain by (each stage's next stage, the gateway's first stage) stay valid and nothing needs re-pointing. The
restart waits a backoff that doubles with each death of that stage within a window, up to a cap: a stage that dies
at once again is not restarted in a tight loop, and one that died once long ago starts again quickly. A stage that
dies more often than the window allows is given up on: `strata serve` then exits non-zero with the end of its log,
because a person has to look, and a gateway answering 503 forever tells them nothing.

What to do is decided by `RestartPolicy.decide`, a pure function of the stage's death times, so the schedule and the
give-up rule are tested without processes or clocks. `StageSupervisor` is the thin executor: a thread that notices a
dead stage, asks the policy, waits out the backoff (on an event, so stopping never waits for it), starts the stage
again, and tells its owner through callbacks. The owner (strata.gateway.serve_command) fences the dead stage's term
off and re-claims every stage with a new one: the stages that lived still hold slots and prefix snapshots of the old
run, the restarted one holds none. The unit is a process: stages that share one (strata.gateway.local_plan's
groups) die and come back together, on the ports they had.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Protocol, TypeVar

from strata.gateway.local import StageStartError

DEFAULT_POLL_INTERVAL_S = 0.2
STOP_JOIN_TIMEOUT_S = 10.0  # a start in progress ends within a select round of the cancel, then stops its child


@dataclass(frozen=True)
class Restart:
    """Start the stage again after `delay_s`; this is restart number `attempt` within the window."""

    delay_s: float
    attempt: int


@dataclass(frozen=True)
class GiveUp:
    """The stage died `deaths` times within the window: more than the policy restarts."""

    deaths: int


@dataclass(frozen=True, kw_only=True)
class RestartPolicy:
    """Bounded exponential backoff, and a limit on restarts within a sliding window.

    The k-th death within `window_s` (counting the one just now) waits `first_backoff_s * 2**(k-1)`, never more than
    `max_backoff_s`; the death that would be restart `max_restarts + 1` within the window gives up instead. Deaths
    older than the window are forgotten, so a stage that runs for a while starts from the first backoff again (the
    kubelet resets its crash-loop backoff the same way). `max_restarts=0` gives up at the first death.
    """

    first_backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    max_restarts: int = 5
    window_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.first_backoff_s <= self.max_backoff_s:
            raise ValueError(f"backoff needs 0 < first ({self.first_backoff_s}) <= max ({self.max_backoff_s}) seconds")
        if self.max_restarts < 0:
            raise ValueError(f"restarts must not be negative, not {self.max_restarts}")
        if self.window_s <= 0:
            raise ValueError(f"the restart window must be positive, not {self.window_s} s")

    def decide(self, deaths: Sequence[float]) -> Restart | GiveUp:
        """What to do about a stage whose deaths happened at `deaths` (monotonic seconds, oldest first; the last one
        is the death being decided on)."""
        if not deaths:
            raise ValueError("decide() is asked about a death: give at least one")
        now = deaths[-1]
        recent = sum(1 for t in deaths if now - t < self.window_s)
        if recent > self.max_restarts:
            return GiveUp(deaths=recent)
        return Restart(delay_s=min(self.max_backoff_s, self.first_backoff_s * 2 ** (recent - 1)), attempt=recent)


class StageKeepsDyingError(RuntimeError):
    """A stage died more often than the restart policy allows; carries how it last died and the end of its log."""

    def __init__(
        self, *, stage: int, name: str, deaths: int, window_s: float, cause: str, log_path: Path, log_tail: str
    ) -> None:
        super().__init__(
            f"{name} died {deaths} times within {window_s:g} s, the last time {cause}; "
            f"giving up. The end of its log ({log_path}):\n{log_tail}"
        )
        self.stage = stage  # the index of the process among those supervised
        self.cause = cause
        self.log_tail = log_tail


class SupervisedStage(Protocol):
    """What the supervisor needs of a stage process (strata.gateway.local.StageProcess)."""

    @property
    def name(self) -> str:
        """How messages call it: 'stage 1', or 'the process of stages 0 and 1'."""

    @property
    def ports(self) -> tuple[int, ...]: ...

    @property
    def log_path(self) -> Path: ...

    @property
    def exit_code(self) -> int | None: ...

    def running(self) -> bool: ...

    def log_tail(self, lines: int = 20) -> str: ...

    def stop(self, *, grace_s: float = 5.0) -> None: ...


S = TypeVar("S", bound=SupervisedStage)


def on_ports(ports: tuple[int, ...]) -> str:
    """'port 5001', 'ports 5000 and 5001'."""
    if len(ports) == 1:
        return f"port {ports[0]}"
    return f"ports {', '.join(map(str, ports[:-1]))} and {ports[-1]}"


def exit_cause(code: int | None) -> str:
    """How a process ended, in words: 'was killed by SIGKILL', 'exited with status 1'."""
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class StageSupervisor(Generic[S]):
    """Watches `stages` from a thread of its own and starts a dead one again by the policy.

    `start(index, cancel)` starts stage process `index` again on its ports; `cancel` is set when the supervisor stops,
    and should cut a start under way short. `stages` is kept current in place: a restarted stage replaces the dead
    one at its index, so whoever stops the stages after `stop()` stops the live ones. The thread that starts a stage
    must outlive it (the stages get PR_SET_PDEATHSIG, which fires when the thread that forked them ends), so the
    thread runs until `stop()` even after giving up.
    """

    def __init__(
        self,
        stages: list[S],
        *,
        start: Callable[[int, threading.Event], S],
        policy: RestartPolicy,
        report: Callable[[str], None] = lambda _line: None,
        poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stages = stages
        self.policy = policy
        self.failure: StageKeepsDyingError | None = None
        self._start = start
        self._report = report
        self._poll_interval_s = poll_interval_s
        self._clock = clock
        self._deaths: dict[int, list[float]] = {index: [] for index in range(len(stages))}
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._on_lost: Callable[[int], None] = lambda _index: None
        self._on_gave_up: Callable[[StageKeepsDyingError], None] = lambda _error: None

    def start(self, *, on_lost: Callable[[int], None], on_gave_up: Callable[[StageKeepsDyingError], None]) -> None:
        """Begin watching. `on_lost(index)` runs when a stage is found dead, before it is restarted; `on_gave_up`
        once, when the policy gives up. Both run on the supervisor's thread and must return at once."""
        self._on_lost, self._on_gave_up = on_lost, on_gave_up
        self._thread = threading.Thread(target=self._watch, name="stage-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching and restarting (a backoff or a start under way is cut short). The stages keep running."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(STOP_JOIN_TIMEOUT_S)

    def _watch(self) -> None:
        while not self._stopping.wait(self._poll_interval_s):
            if self.failure is not None:
                continue  # given up: wait for stop(), see the class docstring
            for index, stage in enumerate(self.stages):
                if not stage.running():
                    self._recover(index, stage)
                if self.failure is not None or self._stopping.is_set():
                    break

    def _recover(self, index: int, dead: S) -> None:
        """Restart stage `index` until one start succeeds, the policy gives up, or the supervisor stops."""
        cause, tail, log_path = exit_cause(dead.exit_code), dead.log_tail(), dead.log_path
        dead.stop(grace_s=0)  # reaps it and closes its log
        self._on_lost(index)
        while not self._stopping.is_set():
            self._deaths[index].append(self._clock())
            decision = self.policy.decide(self._deaths[index])
            if isinstance(decision, GiveUp):
                self.failure = StageKeepsDyingError(
                    stage=index,
                    name=dead.name,
                    deaths=decision.deaths,
                    window_s=self.policy.window_s,
                    cause=cause,
                    log_path=log_path,
                    log_tail=tail,
                )
                self._on_gave_up(self.failure)
                return
            self._report(
                f"{dead.name} {cause}; restarting it on {on_ports(dead.ports)} in {decision.delay_s:g} s "
                f"(restart {decision.attempt} of at most {self.policy.max_restarts} within {self.policy.window_s:g} s)"
            )
            if self._stopping.wait(decision.delay_s):
                return
            try:
                self.stages[index] = self._start(index, self._stopping)
            except StageStartError as exc:
                cause, tail = f"did not start again ({exc.reason})", exc.log_tail
                continue
            back = self.stages[index]
            self._report(f"{back.name} restarted on {on_ports(back.ports)}; it loads, then serves again")
            return
