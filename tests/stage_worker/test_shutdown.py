"""A stage process's stop under its deadline (strata.stage_worker.shutdown): a process whose stop ends and whose
threads end exits as it would have; one that a thread holds says which thread and where, and exits with status 1,
instead of waiting at the interpreter's exit forever. Each case runs in a process of its own: the held case ends it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest
from strata.stage_worker.shutdown import EXIT_HELD


@dataclass(frozen=True)
class Case:
    name: str
    setup: str  # runs before the stop; `release` is a threading.Event nothing sets
    stop: str  # the body of the stop function
    status: int
    logged: tuple[str, ...]  # each appears in the process's log


CASES = [
    Case("a stop that ends, no thread left", "", "pass", 0, ()),
    Case(
        "a thread that ends within the deadline",
        "threading.Thread(target=time.sleep, args=(0.5,), name='short').start()",
        "pass",
        0,
        (),
    ),
    Case(
        "a thread blocked for good is named with its stack",
        "threading.Thread(target=release.wait, name='blocked-handler').start()",
        "pass",
        EXIT_HELD,
        ("did not stop within 2 s of SIGTERM", "blocked-handler", "in wait"),
    ),
    Case(
        "a stop that never returns is named",
        "",
        "release.wait()",
        EXIT_HELD,
        ("stop test worker", "1 thread(s) still running"),
    ),
    Case("a daemon thread does not hold the process", "threading.Thread(target=release.wait, daemon=True).start()",
         "pass", 0, ()),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_stop_ends_or_names_what_held_it(case: Case) -> None:
    script = textwrap.dedent(f"""
        import logging, threading, time
        from strata.stage_worker.shutdown import stop_within
        logging.basicConfig(level=logging.INFO)
        release = threading.Event()
        {case.setup}
        def stop():
            {case.stop}
        stop_within(stop, deadline_s=2.0, what="test worker")
        print("returned", flush=True)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == case.status, result.stderr
    assert ("returned" in result.stdout) == (case.status == 0)
    for text in case.logged:
        assert text in result.stderr, result.stderr
