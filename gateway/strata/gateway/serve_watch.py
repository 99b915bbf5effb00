"""`strata serve` watching its stages load: "ready" once all have loaded and the gateway's probe passed; the first
failure, printed at once, stops serve with a non-zero exit.

Stages are watched from the moment each starts, while the next ones are still starting, so a stage that fails at
once (a file cut short, a cache type it cannot store, memory that runs out) is reported within a poll, not after the
other stages have started. A stage that reports a failed load is not started again: the same file in the same memory
fails the same way, and a person has to act, so serve stops at once with that stage's message. A stage whose process
dies is the supervisor's (strata.gateway.supervision), which starts it again as a crashed pod would be: it tells this
watch (`restarted`), which then watches that stage load again under a deadline of its own, and it reports the stage it
gives up on through `fail`, so serve stops on every failure the same way. Every wait here ends: on a stage's failure,
or at a deadline. Once `close` is called (Ctrl-C, or serve stopping for another reason) nothing more is reported.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from strata.gateway.serve_lines import say
from strata.stage_loading import LoadWatch, StageLoadError, WatchedStage

POLL_S = 0.2


class ServeWatch:
    def __init__(self, *, load_timeout_s: float, ready_timeout_s: float = 120.0) -> None:
        self.load_timeout_s = load_timeout_s  # per stage, from its start or restart
        self.ready_timeout_s = ready_timeout_s  # after loading: the gateway's claim and probe through every stage
        self.failed = threading.Event()  # set with `failure`: serve stops
        self.failure = ""
        self._loads = LoadWatch()
        self._addresses: dict[int, str] = {}
        self._restarted: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._all_started = threading.Event()
        self._closing = threading.Event()
        self._failing = threading.Lock()  # guards `failure`, `failed` and `_on_failure` together
        self._on_failure: list[Callable[[], None]] = []
        self._pipeline_ready: Callable[[], str | None] = lambda: "not started"
        self._thread = threading.Thread(target=self._run, name="serve-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def add(self, *, index: int, address: str) -> None:
        """Watch stage `index`, which has started at `address` (it listens, and loads in the background)."""
        self._addresses[index] = address
        self._loads.add(WatchedStage(address=address, name=f"stage {index}"))

    def all_started(self, *, pipeline_ready: Callable[[], str | None]) -> None:
        """Every stage is started; `pipeline_ready` says why the gateway is not ready yet, or None once it is."""
        self._pipeline_ready = pipeline_ready
        self._all_started.set()

    def restarted(self, index: int) -> None:
        """Stage `index` died and is being started again on its address: watch it load again. Any thread may call
        this; the watch's own thread applies it, after any answer the dead process gave before it died."""
        self._restarted.put(self._addresses[index])

    def on_failure(self, callback: Callable[[], None]) -> None:
        """Call `callback` when serve must stop for a failure: at once if it already must, otherwise from the thread
        that reports the failure. It must return at once."""
        with self._failing:
            if not self.failed.is_set():
                self._on_failure.append(callback)
                return
        callback()

    def fail(self, message: str) -> None:
        """Stop serve for `message`: printed at once, then `failed` is set and the `on_failure` callbacks run. The
        first failure wins; none is reported once serve is stopping."""
        with self._failing:
            if self._closing.is_set() or self.failed.is_set():
                return
            self.failure = message
            say(f"strata serve: {message}", error=True)
            self.failed.set()
            callbacks = list(self._on_failure)
        for callback in callbacks:
            callback()

    def close(self) -> None:
        self._closing.set()

    def _run(self) -> None:
        announced = False
        loaded_at: float | None = None  # when every stage was last seen loaded, until "ready" is announced
        try:
            while not self._closing.is_set():
                while not self._restarted.empty():
                    self._loads.reload(self._restarted.get())
                if not (self._loads.poll() and self._all_started.is_set()):
                    late = self._loads.overdue(self.load_timeout_s)
                    if late is not None:
                        raise late
                    loaded_at = None
                elif not announced:
                    loaded_at = time.monotonic() if loaded_at is None else loaded_at
                    why = self._pipeline_ready()
                    if why is None:
                        say("ready")
                        announced = True
                    elif time.monotonic() - loaded_at > self.ready_timeout_s:
                        waited = f"{self.ready_timeout_s:g} s"
                        self.fail(f"every stage loaded, yet the gateway is not ready after {waited}: {why}")
                        return
                self._closing.wait(POLL_S)
        except StageLoadError as error:
            self.fail(str(error))
        finally:
            self._loads.close()
