"""`strata serve`'s lines are written whole: one write a line, so a line another thread writes never lands inside one
(print writes a line's text and its newline separately, which ran a stage's failure into the "serving" line)."""

from __future__ import annotations

import io
import sys
import threading

import pytest
from strata.gateway.serve_lines import say


class Writes(io.StringIO):
    """A stream that keeps each write apart."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


@pytest.mark.parametrize("error", [False, True], ids=["stdout", "stderr"])
def test_a_line_is_one_write_ending_in_its_newline(monkeypatch: pytest.MonkeyPatch, error: bool) -> None:
    stream = Writes()
    monkeypatch.setattr(sys, "stderr" if error else "stdout", stream)
    say("strata serve: stage 1 failed to load", error=error)
    assert stream.writes == ["strata serve: stage 1 failed to load\n"]


def test_lines_from_many_threads_stay_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = Writes()
    monkeypatch.setattr(sys, "stdout", stream)
    monkeypatch.setattr(sys, "stderr", stream)

    def lines(n: int) -> None:
        for i in range(200):
            say(f"thread {n} line {i}", error=n % 2 == 1)

    threads = [threading.Thread(target=lines, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    written = stream.getvalue().splitlines()
    assert sorted(written) == sorted(f"thread {n} line {i}" for n in range(4) for i in range(200))
