"""A real `strata serve` with n-gram speculation over two stages, through the HTTP API: the text, streamed or whole and
cut by a stop sequence or not, is the plain server's; the tokens of a verified run reach a client together, one
event for the run, not one a token."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from strata_testbed.serve import Served, strata_serve

# A generated model's greedy continuation falls into loops: n-gram lookup finds drafts in it, and in a repeating prompt.
PROMPT = [*range(30, 50), *range(30, 45), 7, 8, *range(30, 40)]
TOKENS = 24


@pytest.fixture(scope="module")
def speculating(qwen2_model: Path) -> Iterator[Served]:
    options = ("--stages", "2", "--parallel", "2", "--context", "1024", "--speculative", "ngram")
    with strata_serve(str(qwen2_model), *options) as served:
        yield served


def completion(server: Served, **fields: object) -> dict[str, Any]:
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, **fields}
    reply = httpx.post(f"{server.base_url}/completions", json=body, timeout=60)
    reply.raise_for_status()
    return dict(reply.json())


def streamed(server: Served, **fields: object) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The text events of a streamed completion, and its usage."""
    body = {
        "model": server.model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}, **fields,
    }  # fmt: skip
    events: list[dict[str, Any]] = []
    usage: dict[str, Any] = {}
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=60) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line.removeprefix("data: "))
            events.extend(c for c in event["choices"] if c["text"] or c["finish_reason"] or c.get("logprobs"))
            usage = event.get("usage") or usage
    return events, usage


def accepted(server: Served) -> float:
    return server.metric("strata_gateway_speculative_accepted_tokens_total")


def test_the_whole_text_is_the_plain_servers(speculating: Served, two_stages: Served) -> None:
    before = accepted(speculating)
    on, off = completion(speculating), completion(two_stages)
    assert on["choices"] == off["choices"]
    assert accepted(speculating) > before, "the workload is one where drafts are accepted"


def test_a_verified_run_streams_as_one_event_and_the_text_is_the_same(speculating: Served) -> None:
    before = accepted(speculating)
    events, usage = streamed(speculating, logprobs=0)
    taken = accepted(speculating) - before
    whole = completion(speculating, logprobs=0)["choices"][0]
    assert "".join(e["text"] for e in events) == whole["text"]
    assert [e["finish_reason"] for e in events if e["finish_reason"]] == ["length"]
    assert usage["completion_tokens"] == TOKENS
    # Each step lands its pick and the drafts it accepted: TOKENS - taken steps, an event each (the last one's
    # finish reason comes in an event of its own, with no tokens).
    runs = [len(e["logprobs"]["tokens"]) for e in events if e.get("logprobs") and e["logprobs"]["tokens"]]
    assert sum(runs) == TOKENS
    assert [t for e in events if e.get("logprobs") for t in e["logprobs"]["tokens"]] == whole["logprobs"]["tokens"]
    assert taken > 0
    assert len(runs) <= TOKENS - taken, "each accepted draft token arrives in its run's event"


def test_a_stop_sequence_inside_a_verified_run_ends_the_text_where_the_plain_server_does(
    speculating: Served, two_stages: Served
) -> None:
    text = completion(two_stages)["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    on, off = completion(speculating, stop=[stop]), completion(two_stages, stop=[stop])
    events, _ = streamed(speculating, stop=[stop])
    assert on["choices"] == off["choices"]
    assert on["choices"][0]["finish_reason"] == "stop"
    assert "".join(e["text"] for e in events) == on["choices"][0]["text"]
    assert [e["finish_reason"] for e in events if e["finish_reason"]] == ["stop"]
