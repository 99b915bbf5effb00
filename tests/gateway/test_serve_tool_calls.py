"""A two-turn tool exchange with the official `openai` client against a real `strata serve` on random weights.

The generated model's template knows nothing of tools, so the gateway uses the generic format; `tool_choice` forces
the call, so the grammar makes random weights write one: the call parses, its result goes back as a tool message,
and the second turn answers in text.
"""

from __future__ import annotations

import json

import openai
import pytest
from openai import OpenAI
from openai.types.chat import (
    ChatCompletionMessageParam,
    ChatCompletionToolChoiceOptionParam,
    ChatCompletionToolParam,
)
from strata_testbed.serve import Served

WEATHER: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["a"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture
def client(two_stages: Served) -> OpenAI:
    return OpenAI(base_url=two_stages.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize(
    "tool_choice",
    [
        pytest.param({"type": "function", "function": {"name": "get_weather"}}, id="a named function"),
        pytest.param("required", id="required"),
    ],
)
def test_a_forced_call_parses_and_its_result_gets_a_second_turn(
    client: OpenAI, two_stages: Served, tool_choice: ChatCompletionToolChoiceOptionParam
) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the weather in Oslo?"}]
    first = client.chat.completions.create(
        model=two_stages.model,
        messages=messages,
        tools=[WEATHER, ADD] if tool_choice == "required" else [WEATHER],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_completion_tokens=120,
        seed=3,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None
    assert len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function"
    assert call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(arguments) == {"city", "unit"}
        assert len(arguments["city"]) <= 12
    else:
        assert call.function.name == "add"
        assert 0 <= arguments["a"] <= 9

    messages += [
        choice.message.model_dump(exclude_none=True),  # type: ignore[list-item]  # the reply, sent back as is
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})},
    ]
    second = client.chat.completions.create(
        model=two_stages.model,
        messages=messages,
        tools=[WEATHER],
        tool_choice="none",
        max_completion_tokens=8,
        seed=4,
    )
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length")
    assert answer.message.tool_calls is None
    assert answer.message.content


def test_a_streamed_forced_call_arrives_as_tool_call_deltas(client: OpenAI, two_stages: Served) -> None:
    request = {
        "model": two_stages.model,
        "messages": [{"role": "user", "content": "Add something."}],
        "tools": [ADD],
        "tool_choice": "required",
        "max_completion_tokens": 120,
        "seed": 5,
    }
    whole = client.chat.completions.create(**request)  # type: ignore[call-overload]
    chunks = list(client.chat.completions.create(**request, stream=True))  # type: ignore[call-overload]
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert deltas
    assert all(d.type == "function" and d.id for d in deltas)
    assert whole.choices[0].message.tool_calls is not None
    streamed = [(d.function.name, d.function.arguments) for d in deltas if d.function]
    assert streamed == [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        pytest.param({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
                     id="a named function that is not among the tools"),
        pytest.param({"tools": None, "tool_choice": "required"}, "tool_choice", id="a call required without tools"),
        pytest.param({"tools": [WEATHER, WEATHER]}, "tools", id="two tools of one name"),
        pytest.param({"response_format": {"type": "json_object"}}, "response_format",
                     id="response_format together with tools"),
    ],
)  # fmt: skip
def test_a_tool_request_that_cannot_be_honoured_is_a_400(
    client: OpenAI, two_stages: Served, fields: dict[str, object], param: str
) -> None:
    body = {"model": two_stages.model, "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**body)  # type: ignore[call-overload]
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["param"] == param


def test_with_tool_choice_auto_the_generic_reply_is_a_call_or_an_answer_never_its_json(
    client: OpenAI, two_stages: Served
) -> None:
    for seed in range(4):
        reply = client.chat.completions.create(
            model=two_stages.model,
            messages=[{"role": "user", "content": "Add or answer."}],
            tools=[ADD],
            max_completion_tokens=60,
            temperature=0.5,
            seed=seed,
        )
        choice = reply.choices[0]
        if choice.finish_reason == "tool_calls":
            assert choice.message.tool_calls is not None
            calls = choice.message.tool_calls
            assert [c.function.name for c in calls if c.type == "function"] == ["add"] * len(calls)
        elif choice.finish_reason == "stop":
            assert choice.message.tool_calls is None
            assert not (choice.message.content or "").startswith('{"response"')
