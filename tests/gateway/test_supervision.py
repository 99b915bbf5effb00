"""The restart policy of `strata serve`'s stages as a pure function of death times, and the executor on fake stages.

The policy is checked without processes or clocks: the backoff doubles per death within the window up to its cap, a
death beyond the allowed restarts gives up, deaths older than the window are forgotten. The executor is checked on
stand-ins for stage processes, with backoffs of milliseconds: it restarts a dead stage in place and says so before,
gives up with the end of the last log, and stops at once even in the middle of a long backoff.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from strata.gateway.local import StageStartError
from strata.gateway.supervision import (
    GiveUp,
    Restart,
    RestartPolicy,
    StageKeepsDyingError,
    StageSupervisor,
    exit_cause,
)

POLICY = RestartPolicy(first_backoff_s=0.5, max_backoff_s=8.0, max_restarts=5, window_s=60.0)
WAIT_S = 10.0  # the longest a test waits for the supervisor's thread to act


@pytest.mark.parametrize(
    ("deaths", "decision"),
    [
        pytest.param([100.0], Restart(delay_s=0.5, attempt=1), id="the first death restarts after the first backoff"),
        pytest.param([100.0, 101.0], Restart(delay_s=1.0, attempt=2), id="a second death within the window doubles it"),
        pytest.param(
            [100.0, 101.0, 103.0, 107.0], Restart(delay_s=4.0, attempt=4), id="each death within the window doubles it"
        ),
        pytest.param(
            [100.0, 101.0, 102.0, 103.0, 104.0],
            Restart(delay_s=8.0, attempt=5),
            id="the last restart allowed waits the capped backoff",
        ),
        pytest.param([100.0, 101.0, 102.0, 103.0, 104.0, 105.0], GiveUp(deaths=6), id="one death more gives up"),
        pytest.param(
            [0.0, 1.0, 2.0, 3.0, 4.0, 100.0],
            Restart(delay_s=0.5, attempt=1),
            id="deaths older than the window are forgotten: back to the first backoff",
        ),
        pytest.param(
            [40.0, 100.0], Restart(delay_s=0.5, attempt=1), id="a death exactly a window ago is out of the window"
        ),
        pytest.param(
            [40.0, 100.0, 101.0], Restart(delay_s=1.0, attempt=2), id="only the deaths within the window count"
        ),
    ],
)
def test_the_policy_backs_off_exponentially_and_gives_up_beyond_its_restarts(
    deaths: list[float], decision: Restart | GiveUp
) -> None:
    assert POLICY.decide(deaths) == decision


@pytest.mark.parametrize(
    ("policy", "deaths", "decision"),
    [
        pytest.param(
            RestartPolicy(first_backoff_s=1.0, max_backoff_s=3.0),
            [1.0, 2.0, 3.0],
            Restart(delay_s=3.0, attempt=3),
            id="the backoff never exceeds its cap",
        ),
        pytest.param(
            RestartPolicy(max_restarts=0), [1.0], GiveUp(deaths=1), id="no restarts: the first death gives up"
        ),
        pytest.param(
            RestartPolicy(max_restarts=1, window_s=10.0),
            [1.0, 5.0],
            GiveUp(deaths=2),
            id="one restart: a second death within the window gives up",
        ),
    ],
)
def test_the_policy_follows_its_settings(
    policy: RestartPolicy, deaths: list[float], decision: Restart | GiveUp
) -> None:
    assert policy.decide(deaths) == decision


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        pytest.param({"first_backoff_s": 0.0}, "backoff", id="a zero backoff would restart in a tight loop"),
        pytest.param({"first_backoff_s": 9.0, "max_backoff_s": 8.0}, "backoff", id="a cap below the first backoff"),
        pytest.param({"max_restarts": -1}, "restarts", id="negative restarts"),
        pytest.param({"window_s": 0.0}, "window", id="an empty window"),
    ],
)
def test_a_policy_that_makes_no_sense_is_refused_naming_the_setting(settings: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RestartPolicy(**settings)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("code", "cause"),
    [
        pytest.param(-9, "was killed by SIGKILL", id="a signal is named"),
        pytest.param(1, "exited with status 1", id="an exit status is given"),
        pytest.param(None, "is still running", id="no status yet"),
    ],
)
def test_how_a_stage_ended_is_said_in_words(code: int | None, cause: str) -> None:
    assert exit_cause(code) == cause


# The executor, on stand-ins for stage processes.


@dataclass(eq=False)
class FakeStage:
    port: int
    log_path: Path = Path("/logs/stage.log")
    exit_code: int | None = None
    stopped: bool = False

    @property
    def name(self) -> str:
        return f"stage {self.port - 5000}"

    @property
    def ports(self) -> tuple[int, ...]:
        return (self.port,)

    def running(self) -> bool:
        return self.exit_code is None

    def log_tail(self, lines: int = 20) -> str:
        return f"the log of the stage on port {self.port}"

    def stop(self, *, grace_s: float = 5.0) -> None:
        self.stopped = True


@dataclass
class Starts:
    """The stage starter: a new FakeStage on the same port, or the StageStartError it is told to raise."""

    fail_with: str = ""
    calls: list[int] = field(default_factory=list)
    started: list[FakeStage] = field(default_factory=list)

    def __call__(self, index: int, cancel: threading.Event) -> FakeStage:
        self.calls.append(index)
        if self.fail_with:
            raise StageStartError("it exited with status 1", log_path=Path("/logs/stage.log"), log_tail=self.fail_with)
        stage = FakeStage(port=5000 + index)
        self.started.append(stage)
        return stage


@dataclass
class Events:
    lost: list[int] = field(default_factory=list)
    gave_up: list[StageKeepsDyingError] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)

    def on_lost(self, index: int) -> None:
        with self.changed:
            self.lost.append(index)
            self.changed.notify_all()

    def on_gave_up(self, error: StageKeepsDyingError) -> None:
        with self.changed:
            self.gave_up.append(error)
            self.changed.notify_all()

    def report(self, line: str) -> None:
        with self.changed:
            self.lines.append(line)
            self.changed.notify_all()

    def wait(self, what: str, predicate: Callable[[], object]) -> None:
        with self.changed:
            assert self.changed.wait_for(predicate, timeout=WAIT_S), f"timed out waiting for {what}: {self}"


@contextmanager
def supervising(
    stages: list[FakeStage], starts: Starts, policy: RestartPolicy, events: Events
) -> Iterator[StageSupervisor[FakeStage]]:
    supervisor = StageSupervisor(stages, start=starts, policy=policy, report=events.report, poll_interval_s=0.01)
    supervisor.start(on_lost=events.on_lost, on_gave_up=events.on_gave_up)
    try:
        yield supervisor
    finally:
        supervisor.stop()


FAST = RestartPolicy(first_backoff_s=0.001, max_backoff_s=0.004, max_restarts=2, window_s=60.0)


def test_a_dead_stage_is_reported_lost_then_started_again_in_its_place() -> None:
    stages = [FakeStage(port=5000), FakeStage(port=5001)]
    dead = stages[1]
    starts, events = Starts(), Events()
    with supervising(stages, starts, FAST, events) as supervisor:
        dead.exit_code = -9
        events.wait("the restart", lambda: any("restarted" in line for line in events.lines))
    assert events.lost == [1]
    assert starts.calls == [1]
    assert stages == [stages[0], starts.started[0]], "the new stage replaced the dead one in the list"
    assert dead.stopped, "the dead one was reaped"
    assert supervisor.failure is None
    assert events.lines == [
        "stage 1 was killed by SIGKILL; restarting it on port 5001 in 0.001 s (restart 1 of at most 2 within 60 s)",
        "stage 1 restarted on port 5001; it loads, then serves again",
    ]


def test_a_stage_that_cannot_start_again_is_given_up_on_with_the_end_of_its_last_log() -> None:
    stages = [FakeStage(port=5000)]
    starts, events = Starts(fail_with="OSError: cannot listen on 127.0.0.1:5000"), Events()
    with supervising(stages, starts, FAST, events) as supervisor:
        stages[0].exit_code = 1
        events.wait("giving up", lambda: events.gave_up)
    assert starts.calls == [0, 0], "two restarts allowed, both failed; the third death gives up"
    assert events.lost == [0], "lost once: the failed starts are the same outage"
    [error] = events.gave_up
    assert supervisor.failure is error
    assert error.stage == 0
    assert str(error).startswith(
        "stage 0 died 3 times within 60 s, the last time did not start again (it exited with status 1); giving up."
    )
    assert "OSError: cannot listen on 127.0.0.1:5000" in str(error)


def test_stopping_cuts_a_long_backoff_short_and_starts_nothing() -> None:
    stages = [FakeStage(port=5000)]
    starts, events = Starts(), Events()
    slow = RestartPolicy(first_backoff_s=60.0, max_backoff_s=60.0)
    with supervising(stages, starts, slow, events) as supervisor:
        stages[0].exit_code = -9
        events.wait("the backoff to begin", lambda: events.lines)
        stopping = time.monotonic()
        supervisor.stop()
        assert time.monotonic() - stopping < 1.0
    assert starts.calls == []
