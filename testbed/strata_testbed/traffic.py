"""Traffic for the test bed's gateway: streamed completions read on threads, and the per-pipeline gauges an
autoscaler reads, so a test can see that every pipeline has work in flight before it acts."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass
class StreamResult:
    """What one streamed completion got: its HTTP status, each text piece, how it ended."""

    status: int = 0
    pieces: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int | None = None  # from the usage chunk
    error: dict[str, Any] | None = None  # an error chunk, or the body of a refused request
    done: bool = False  # the stream ended with [DONE]
    failure: str = ""  # the client's own failure (a timeout, a broken connection)


class Streamed:
    """One streamed completion on a thread of its own, read to its end (or until `timeout_s` passes)."""

    def __init__(self, url: str, body: dict[str, Any], *, timeout_s: float) -> None:
        self.url = url
        self.body = body | {"stream": True, "stream_options": {"include_usage": True}}
        self.timeout_s = timeout_s
        self.result = StreamResult()
        self.first_piece = threading.Event()  # set once it has generated something
        self._thread = threading.Thread(target=self._run, name="streamed-completion", daemon=True)

    def start(self) -> Streamed:
        self._thread.start()
        return self

    def join(self, timeout_s: float) -> StreamResult:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise AssertionError(f"a streamed completion did not end within {timeout_s:g} s: {self.result}")
        return self.result

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        result = self.result
        try:
            with httpx.stream("POST", f"{self.url}/completions", json=self.body, timeout=self.timeout_s) as reply:
                result.status = reply.status_code
                if reply.status_code != 200:
                    reply.read()
                    result.error = reply.json()
                    return
                for line in reply.iter_lines():
                    self._take(line.removeprefix("data: ").strip())
        except httpx.HTTPError as e:
            result.failure = f"{type(e).__name__}: {e}"
        finally:
            self.first_piece.set()  # an ended stream wakes whoever waits for its start

    def _take(self, data: str) -> None:
        result = self.result
        if not data:
            return
        if data == "[DONE]":
            result.done = True
            return
        chunk = json.loads(data)
        if "error" in chunk:
            result.error = chunk
            return
        if chunk.get("usage"):
            result.completion_tokens = chunk["usage"]["completion_tokens"]
        for choice in chunk.get("choices") or ():
            if choice.get("text"):
                result.pieces.append(choice["text"])
                self.first_piece.set()
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]


def pipeline_gauges(root: str, name: str) -> dict[int, float]:
    """The gateway's per-pipeline gauge `name` (strata_gateway_pipeline_...), by pipeline index, from /metrics."""
    text = httpx.get(f"{root}/metrics", timeout=5).text
    found: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and "pipeline" in sample.labels:
                found[int(sample.labels["pipeline"])] = sample.value
    return found
