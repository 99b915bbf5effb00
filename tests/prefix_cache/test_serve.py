"""The prefix cache through a real `strata serve` and the official `openai` client: cached prompt tokens in usage as
OpenAI reports them, the same text as a server without the cache, and the counters in /metrics."""

from __future__ import annotations

import pytest
from openai import OpenAI
from strata_testbed.serve import Served

SYSTEM = "You are a careful assistant for a pipeline team. " * 8  # several 16-token chunks


def client(served: Served) -> OpenAI:
    return OpenAI(base_url=served.base_url, api_key="unused", max_retries=0, timeout=60)


def chat(served: Served, question: str, **extra: object) -> tuple[str, int, int]:
    """(text, prompt tokens, cached prompt tokens) of a greedy chat completion."""
    reply = client(served).chat.completions.create(  # type: ignore[call-overload]
        model=served.model,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=8,
        temperature=0,
        **extra,
    )
    assert reply.usage is not None
    assert reply.usage.prompt_tokens_details is not None
    return (
        reply.choices[0].message.content or "",
        reply.usage.prompt_tokens,
        reply.usage.prompt_tokens_details.cached_tokens,
    )


def test_a_shared_system_prompt_is_restored_and_reported_as_cached_tokens(cache_on: Served, cache_off: Served) -> None:
    questions = ("What is a stage?", "What is a lane?", "What is a stage?")
    on = [chat(cache_on, q) for q in questions]
    off = [chat(cache_off, q) for q in questions]
    assert [text for text, _, _ in on] == [text for text, _, _ in off]
    assert [cached for _, _, cached in off] == [0, 0, 0]
    first, second, again = on
    assert first[2] == 0, "nothing was cached before the first request"
    for _text, prompt, cached in (second, again):
        assert 0 < cached < prompt
        assert cached % 16 == 0


def test_streamed_usage_and_completions_report_cached_tokens_too(cache_on: Served) -> None:
    prompt = list(range(300, 360))
    completions = [
        client(cache_on).completions.create(model=cache_on.model, prompt=prompt, max_tokens=4, temperature=0)
        for _ in range(2)
    ]
    details = [c.usage.prompt_tokens_details for c in completions if c.usage]
    assert [d.cached_tokens if d else None for d in details] == [0, 48]
    assert completions[0].choices[0].text == completions[1].choices[0].text
    chunks = list(
        client(cache_on).chat.completions.create(
            model=cache_on.model,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Streamed?"}],
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.prompt_tokens_details is not None
    assert (usage.prompt_tokens_details.cached_tokens or 0) > 0


@pytest.mark.parametrize(
    ("name", "at_least"),
    [
        pytest.param('strata_gateway_prefix_cache_hits_total{pipeline="0"}', 1, id="hits are counted"),
        pytest.param('strata_gateway_prefix_cache_misses_total{pipeline="0"}', 1, id="misses are counted"),
        pytest.param(
            'strata_gateway_prefix_cache_cached_tokens_total{pipeline="0"}', 16, id="cached tokens are counted"
        ),
        pytest.param('strata_gateway_prefix_cache_bytes{pipeline="0"}', 1, id="the stages' bytes held are shown"),
        pytest.param('strata_gateway_prefix_cache_snapshots{pipeline="0"}', 2, id="the stages' snapshots are shown"),
        pytest.param('strata_gateway_prefix_cache_evictions_total{pipeline="0"}', 0, id="evictions are shown"),
    ],
)
def test_metrics_show_the_prefix_cache(cache_on: Served, name: str, at_least: float) -> None:
    chat(cache_on, "Metrics, please.")
    chat(cache_on, "Metrics again, please.")
    assert cache_on.metric(name) >= at_least


def test_a_cache_salt_shares_cached_prefixes_with_requests_of_that_salt_only(cache_on: Served) -> None:
    """vLLM's `cache_salt`: a tenant's requests restore that tenant's prefixes, never another's or unsalted ones,
    and the text is the same whichever restored what."""
    prompt = list(range(400, 460))

    def cached(salt: str | None) -> tuple[str, int]:
        extra = {} if salt is None else {"extra_body": {"cache_salt": salt}}
        reply = client(cache_on).completions.create(
            model=cache_on.model, prompt=prompt, max_tokens=4, temperature=0, **extra
        )  # type: ignore[call-overload]
        assert reply.usage is not None
        details = reply.usage.prompt_tokens_details
        return reply.choices[0].text, 0 if details is None else details.cached_tokens or 0

    runs = [cached(salt) for salt in ("tenant-a", "tenant-b", None, "tenant-a", "tenant-b")]
    assert [hit for _, hit in runs] == [0, 0, 0, 48, 48]
    assert len({text for text, _ in runs}) == 1
