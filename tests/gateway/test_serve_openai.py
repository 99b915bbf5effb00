"""The official `openai` client against a real `strata serve`: two stage processes and the gateway, on loopback."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai import OpenAI
from strata_testbed.serve import Served


@pytest.fixture
def client(two_stages: Served) -> OpenAI:
    return OpenAI(base_url=two_stages.base_url, api_key="unused", max_retries=0, timeout=60)


def test_models_lists_the_served_model_with_its_context(client: OpenAI, two_stages: Served) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [two_stages.model]
    assert models[0].model_extra == {"context_length": 1024}


@pytest.mark.parametrize(
    "model_suffix", [pytest.param("", id="the plain id"), pytest.param("@main", id="the id with the default revision")]
)
def test_chat_completion_generates_max_tokens_and_reports_usage(
    client: OpenAI, two_stages: Served, model_suffix: str
) -> None:
    reply = client.chat.completions.create(
        model=two_stages.model + model_suffix,
        messages=[{"role": "user", "content": "Tell me about pipelines."}],
        max_tokens=12,
        temperature=0,
    )
    choice = reply.choices[0]
    assert reply.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 12 or choice.finish_reason == "stop"
    assert choice.finish_reason in ("length", "stop")
    assert reply.usage.prompt_tokens > 5
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_streamed_chat_carries_the_same_text_as_the_whole_reply(client: OpenAI, two_stages: Served) -> None:
    request = {
        "model": two_stages.model,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello 👋 there"}],
        "max_tokens": 20,
        "temperature": 0,
    }
    whole = client.chat.completions.create(**request)  # type: ignore[call-overload]
    chunks = list(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))  # type: ignore[call-overload]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        whole.choices[0].finish_reason
    ]
    assert chunks[-1].usage == whole.usage


@pytest.mark.parametrize(
    "prompt",
    [
        pytest.param("The quick brown fox", id="a text prompt"),
        pytest.param([100, 200, 300, 42], id="a prompt of token ids"),
    ],
)
def test_completions_stream_and_whole_agree(client: OpenAI, two_stages: Served, prompt: str | list[int]) -> None:
    whole = client.completions.create(model=two_stages.model, prompt=prompt, max_tokens=10, temperature=0)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=two_stages.model, prompt=prompt, max_tokens=10, temperature=0, stream=True
        )
    )
    assert whole.object == "text_completion"
    assert streamed == whole.choices[0].text
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == (len(prompt) if isinstance(prompt, list) else whole.usage.prompt_tokens)


def test_a_seed_makes_sampling_repeatable(client: OpenAI, two_stages: Served) -> None:
    def sample(seed: int) -> str:
        reply = client.completions.create(
            model=two_stages.model, prompt="Once upon a time", max_tokens=16, temperature=1.0, top_p=0.9, seed=seed
        )
        return reply.choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(s) for s in range(4)}) > 1


def test_a_stop_string_ends_the_text_before_it(client: OpenAI, two_stages: Served) -> None:
    free = client.completions.create(model=two_stages.model, prompt="Hello", max_tokens=24, temperature=0)
    text = free.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"the greedy text {text!r} gives no stop string to test with"
    stopped = client.completions.create(model=two_stages.model, prompt="Hello", max_tokens=24, temperature=0, stop=stop)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]


def test_logprobs_come_back_for_each_token_with_alternatives(client: OpenAI, two_stages: Served) -> None:
    reply = client.chat.completions.create(
        model=two_stages.model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    assert len(content) == 5
    for token in content:
        assert len(token.top_logprobs) == 3
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob, abs=1e-4)  # greedy takes the best


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        pytest.param({"model": "someone/else:Q4", "prompt": "x"}, 404, "model", id="an unknown model is 404"),
        pytest.param({"prompt": "x", "temperature": 3}, 400, "temperature", id="temperature above 2 is 400"),
        pytest.param({"prompt": "x", "n": 3}, 400, "n", id="more choices than lanes is 400"),
        pytest.param({"prompt": "x " * 2000}, 400, "prompt", id="a prompt longer than the context is 400"),
        pytest.param({"prompt": [10**7]}, 400, "prompt", id="a token id outside the vocabulary is 400"),
    ],
)
def test_bad_requests_get_openai_errors_naming_the_parameter(
    two_stages: Served, body: dict[str, object], status: int, param: str
) -> None:
    client = OpenAI(base_url=two_stages.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(**{"model": two_stages.model, "max_tokens": 2, **body})  # type: ignore[call-overload]
    assert caught.value.status_code == status
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["param"] == param
    assert set(error) == {"message", "type", "param", "code"}


def test_health_readiness_and_metrics_answer(two_stages: Served) -> None:
    assert httpx.get(f"{two_stages.root}/healthz").status_code == 200
    assert httpx.get(f"{two_stages.root}/readyz").status_code == 200
    metrics = httpx.get(f"{two_stages.root}/metrics").text
    for name in (
        "strata_gateway_lanes_busy",
        "strata_gateway_queue_depth",
        "strata_gateway_admitted_total",
        "strata_gateway_rejected_total",
        "strata_gateway_time_to_first_token_seconds_bucket",
        "strata_gateway_inter_token_latency_seconds_bucket",
        "strata_gateway_tokens_generated_total",
    ):
        assert name in metrics
