"""Stopping a stage process within a deadline, and saying what held it when it cannot stop.

SIGTERM stops the gRPC servers with a grace period; an open stream (a coordinator's, between its steps) is cancelled
when the grace ends. The interpreter then joins every thread that is not a daemon, the servers' handler threads
among them. A handler blocked for good would hold the process forever after its stop, with nothing said: CI saw a
two-stage process outlive a 30 s wait for its exit once (stop 47) and never since. So the stop and the joins run
under one deadline; past it the process logs the stack of every thread still running and exits with status 1, and
the person reading the log sees what held it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

log = logging.getLogger(__name__)

EXIT_HELD = 1  # the exit status of a process that a thread held past its deadline


def held_threads(deadline: float) -> list[threading.Thread]:
    """The threads the interpreter would join at exit that are still running at `deadline` (time.monotonic)."""
    for thread in threading.enumerate():
        if thread is threading.current_thread() or thread.daemon:
            continue
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    return [t for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon and t.is_alive()]


def stacks(threads: list[threading.Thread]) -> str:
    frames = sys._current_frames()
    parts = []
    for thread in threads:
        frame = frames.get(thread.ident) if thread.ident is not None else None
        where = "".join(traceback.format_stack(frame)) if frame is not None else "  (no frame)\n"
        parts.append(f"thread {thread.name!r}:\n{where}")
    return "".join(parts)


def stop_within(stop: Callable[[], None], *, deadline_s: float, what: str) -> None:
    """Run `stop`, then wait for the threads the interpreter joins at exit, all within `deadline_s` seconds; past it
    log what still runs and end the process with EXIT_HELD (the joins at exit would never end)."""
    deadline = time.monotonic() + deadline_s
    stopper = threading.Thread(target=stop, daemon=True, name=f"stop {what}")
    stopper.start()
    stopper.join(timeout=deadline_s)
    held = held_threads(deadline) if not stopper.is_alive() else [stopper, *held_threads(deadline)]
    if not held:
        return
    log.error(
        "%s did not stop within %.0f s of SIGTERM: %d thread(s) still running (%s); exiting with status %d\n%s",
        what,
        deadline_s,
        len(held),
        ", ".join(t.name for t in held),
        EXIT_HELD,
        stacks(held),
    )
    logging.shutdown()
    os._exit(EXIT_HELD)
