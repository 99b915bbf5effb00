"""`strata serve` watching its stages come up: "ready" once all have loaded and the gateway's probe passed, or the
first failure, printed at once, which stops serve with a non-zero exit.

Stages are watched from the moment each starts, while the next ones are still starting, so a stage that fails at
once (a file cut short, a cache type it cannot store, memory that runs out) is reported within a poll, not after the
other stages have started. Every wait here ends: on a stage's failure (its own message), on its process ending (the
end of its log), or at a deadline. Once `close` is called (Ctrl-C, or serve stopping for another reason) the stages
going away is expected and nothing more is reported.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

from strata.stage_loading import LoadWatch, StageLoadError, WatchedStage

POLL_S = 0.2


class ServeWatch:
    def __init__(self, *, load_timeout_s: float, ready_timeout_s: float = 120.0) -> None:
        self.load_timeout_s = load_timeout_s
        self.ready_timeout_s = ready_timeout_s  # after loading: the gateway's claim and probe through every stage
        self.failed = threading.Event()  # set with `failure`: serve stops
        self.failure = ""
        self._loads = LoadWatch()
        self._all_started = threading.Event()
        self._closing = threading.Event()
        self._pipeline_ready: Callable[[], str | None] = lambda: "not started"
        self._thread = threading.Thread(target=self._run, name="serve-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def add(self, stage: WatchedStage) -> None:
        """Watch a stage that has started (it listens, and loads in the background)."""
        self._loads.add(stage)

    def all_started(self, *, pipeline_ready: Callable[[], str | None]) -> None:
        """Every stage is started; `pipeline_ready` says why the gateway is not ready yet, or None once it is."""
        self._pipeline_ready = pipeline_ready
        self._all_started.set()

    def close(self) -> None:
        self._closing.set()

    def _run(self) -> None:
        started = time.monotonic()
        try:
            while not (self._loads.poll() and self._all_started.is_set()):
                if time.monotonic() - started > self.load_timeout_s:
                    raise self._loads.timed_out(self.load_timeout_s)
                if self._closing.wait(POLL_S):
                    return
            loaded = time.monotonic()
            while (why := self._pipeline_ready()) is not None:
                if time.monotonic() - loaded > self.ready_timeout_s:
                    waited = f"{self.ready_timeout_s:g} s"
                    self._fail(f"every stage loaded, yet the gateway is not ready after {waited}: {why}")
                    return
                if self._closing.wait(POLL_S):
                    return
        except StageLoadError as error:
            self._fail(str(error))
            return
        finally:
            self._loads.close()
        print("ready", flush=True)

    def _fail(self, message: str) -> None:
        if self._closing.is_set():  # serve is stopping: its stages going away is no failure
            return
        self.failure = message
        print(f"strata serve: {message}", file=sys.stderr, flush=True)
        self.failed.set()
