"""Every field of the OpenAI request schema is honoured or refused by name: none is silently ignored.

The schema is the pinned `openai` package's own request types, walked field by field, so a field a new client adds
fails here until it is put in one of the gateway's two tables. The refusals are sent to the in-process app with no
stage behind it: a refused field is a 400 before readiness matters, and a field's no-op value passes on to the 503.
"""

from __future__ import annotations

import asyncio
import typing
from typing import Any

import httpx
import pytest
from openai.types import completion_create_params
from openai.types.chat import chat_completion_message_param
from openai.types.chat import completion_create_params as chat_create_params
from strata.gateway import parameters
from strata.gateway.parameters import Fields
from strata.gateway.server import build
from strata.gateway.settings import GatewaySettings
from strata.gguf.header import GGUFHeader

MODEL = "strata-test-qwen2"
ROLES = {
    typing.get_type_hints(t)["role"].__args__[0]: t
    for t in typing.get_args(chat_completion_message_param.ChatCompletionMessageParam)
}


def openai_fields(params: type) -> set[str]:
    return set(typing.get_type_hints(params))


@pytest.mark.parametrize(
    ("openai_params", "table"),
    [
        pytest.param(chat_create_params.CompletionCreateParamsStreaming, parameters.CHAT, id="chat completions"),
        pytest.param(completion_create_params.CompletionCreateParamsStreaming, parameters.COMPLETION, id="completions"),
    ],
)
def test_each_request_field_is_honoured_or_refused_and_not_both(openai_params: type, table: Fields) -> None:
    fields = openai_fields(openai_params)
    assert fields - table.honoured - set(table.refused) == set(), "fields in neither table"
    assert table.honoured & set(table.refused) == set(), "fields in both tables"
    named = table.honoured | set(table.refused)
    assert named - fields - parameters.EXTENSIONS == set(), "tables name fields the API does not have"


@pytest.mark.parametrize("role", sorted(ROLES))
def test_each_message_field_of_each_role_is_honoured_or_refused(role: str) -> None:
    fields = openai_fields(ROLES[role])
    table = parameters.MESSAGES.get(role)
    if table is None:
        assert role in parameters.REFUSED_ROLES
        return
    assert fields - table.honoured - set(table.refused) == set()
    assert table.honoured & set(table.refused) == set()
    assert (table.honoured | set(table.refused)) - fields == set()


def call(header: GGUFHeader, method: str, path: str, **kwargs: Any) -> httpx.Response:
    settings = GatewaySettings(model_url="unused.gguf", first_stage="127.0.0.1:9", context=64)
    app, _serving = build(settings, header=header)

    async def send() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(send())


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 4, **fields}


REFUSED = [
    *[
        pytest.param("/v1/chat/completions", chat(**{name: value}), name, id=f"chat {name}={value!r}")
        for name, value in {
            "audio": {"voice": "alloy", "format": "wav"},
            "modalities": ["text", "audio"],
            "prediction": {"type": "content", "content": "x"},
            "web_search_options": {},
            "reasoning_effort": "high",
            "verbosity": "low",
            "store": True,
            "service_tier": "flex",
            "prompt_cache_retention": "24h",
            "prompt_cache_options": {},
            "moderation": {},
            "functions": [{"name": "f"}],
            "function_call": "auto",
            "a_field_no_api_has": 1,
        }.items()
    ],
    pytest.param(
        "/v1/chat/completions",
        chat(logit_bias={"10000000": 5}),
        "logit_bias",
        id="a logit bias for a token outside the vocabulary",
    ),
    pytest.param(
        "/v1/completions",
        completion(logit_bias={"hello": 5}),
        "logit_bias",
        id="a logit bias keyed by a word, not a token id",
    ),
    pytest.param(
        "/v1/completions", completion(presence_penalty=2.5), "presence_penalty", id="a presence penalty above 2"
    ),
    *[
        pytest.param("/v1/completions", completion(**{name: value}), name, id=f"completions {name}={value!r}")
        for name, value in {
            "best_of": 2,
            "echo": True,
            "suffix": "tail",
            "a_field_no_api_has": 1,
        }.items()
    ],
    pytest.param(
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": "hi", "name": "ann"}]),
        "messages.0.name",
        id="a participant name",
    ),
    pytest.param(
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": "hi"}, {"role": "function", "name": "f", "content": "1"}]),
        "messages.1.role",
        id="a function-role message",
    ),
    pytest.param(
        "/v1/chat/completions",
        chat(messages=[{"role": "assistant", "content": None, "audio": {"id": "a1"}}]),
        "messages.0.audio",
        id="an assistant message's audio",
    ),
]


@pytest.mark.parametrize(("path", "body", "param"), REFUSED)
def test_a_refused_field_is_a_400_naming_it(
    qwen2_header: GGUFHeader, path: str, body: dict[str, Any], param: str
) -> None:
    response = call(qwen2_header, "POST", path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert param.rpartition(".")[2] in error["message"]


NO_OPS = [
    pytest.param("/v1/chat/completions", chat(n=1, presence_penalty=0, frequency_penalty=0.0), id="chat defaults"),
    pytest.param("/v1/chat/completions", chat(store=False, service_tier="auto"), id="chat no-op values"),
    pytest.param("/v1/chat/completions", chat(user="u1", metadata={"k": "v"}, safety_identifier="s"), id="chat labels"),
    pytest.param("/v1/chat/completions", chat(tools=None, logit_bias=None), id="chat nulls"),
    pytest.param("/v1/completions", completion(n=1, best_of=1, echo=False, suffix=None), id="completion defaults"),
]


@pytest.mark.parametrize(("path", "body"), NO_OPS)
def test_a_refused_field_with_a_value_that_asks_for_nothing_passes(
    qwen2_header: GGUFHeader, path: str, body: dict[str, Any]
) -> None:
    response = call(qwen2_header, "POST", path, json=body)
    assert response.status_code == 503, response.text  # past validation: only the missing pipeline stops it
