"""The lines `strata serve` prints for a person (and for the tools that read them line by line).

Several threads print them: the main thread its plan and endpoint, the watch of the stages' loads a failure or
"ready", the supervisor a restart. Under PYTHONUNBUFFERED `print` writes a line's text and its newline as two writes,
so a line from another thread (stderr joins stdout in one pipe) could land between them and leave two lines run
together on one. Each line here is one write, made and flushed under one lock.
"""

from __future__ import annotations

import sys
import threading

_LOCK = threading.Lock()


def say(line: str, *, error: bool = False) -> None:
    """Print `line` whole on stdout (stderr with `error`), flushed before any other thread prints."""
    stream = sys.stderr if error else sys.stdout
    with _LOCK:
        stream.write(line + "\n")
        stream.flush()
