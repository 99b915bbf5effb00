"""Structured outputs through the official client: `parse()` with a pydantic model returns a valid instance on
random weights, for prompt after prompt, because the grammar leaves the model no other choice.

The generated model's weights are random, so free text is never JSON; every reply here parsing into the model is the
constraint at work, not luck. Bounded keywords (maxLength, maxItems, enum, minimum/maximum) keep each reply short
enough to end well within max_tokens.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field
from strata_testbed.serve import Served

PROMPTS = [f"Describe pet number {i} in JSON, please." for i in range(20)]


class Pet(BaseModel):
    name: Annotated[str, Field(max_length=8)]
    kind: Literal["cat", "dog", "bird"]
    age: Annotated[int, Field(ge=0, le=30)]
    tags: Annotated[list[Annotated[str, Field(max_length=4)]], Field(max_length=2)]
    vaccinated: bool


@pytest.fixture(params=["one_stage", "three_stages"])
def served(request: pytest.FixtureRequest) -> Served:
    served: Served = request.getfixturevalue(request.param)
    return served


def client_for(served: Served) -> OpenAI:
    return OpenAI(base_url=served.base_url, api_key="unused", max_retries=0, timeout=120)


def test_parse_returns_a_valid_instance_for_every_prompt(served: Served) -> None:
    client = client_for(served)
    for i, prompt in enumerate(PROMPTS):
        reply = client.chat.completions.parse(
            model=served.model,
            messages=[{"role": "user", "content": prompt}],
            response_format=Pet,
            max_completion_tokens=200,
            seed=i,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Pet), choice.message.content
        assert Pet.model_validate_json(choice.message.content or "") == choice.message.parsed


def test_a_streamed_parse_returns_a_valid_instance_for_every_prompt(served: Served) -> None:
    client = client_for(served)
    for i, prompt in enumerate(PROMPTS):
        with client.chat.completions.stream(
            model=served.model,
            messages=[{"role": "user", "content": prompt}],
            response_format=Pet,
            max_completion_tokens=200,
            seed=100 + i,
        ) as stream:
            deltas = [e.delta for e in stream if e.type == "content.delta"]
            final = stream.get_final_completion()
        parsed = final.choices[0].message.parsed
        assert isinstance(parsed, Pet)
        assert Pet.model_validate_json("".join(deltas)) == parsed


def test_json_object_mode_writes_a_json_object(two_stages: Served) -> None:
    client = client_for(two_stages)
    for seed in range(5):
        reply = client.chat.completions.create(
            model=two_stages.model,
            messages=[{"role": "user", "content": "Answer in JSON."}],
            response_format={"type": "json_object"},
            max_completion_tokens=300,
            temperature=0.3,  # below 1, so the unbounded free-form object closes well within the limit
            seed=seed,
        )
        choice = reply.choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content or ""), dict)
        else:  # cut by max tokens: still a prefix of an object, never free text
            assert (choice.message.content or "").startswith("{")


@pytest.mark.parametrize(
    "schema",
    [
        pytest.param({"type": "strin"}, id="an unknown type"),
        pytest.param({"type": "string", "format": "not-a-format"}, id="an unknown format"),
        pytest.param({"$ref": "https://example.com/schema.json"}, id="a remote reference, which is never fetched"),
        pytest.param({"allOf": [{"type": "string"}, {"type": "integer"}]}, id="an unsatisfiable schema"),
    ],
)
def test_a_schema_the_grammar_cannot_enforce_is_a_400_naming_it(two_stages: Served, schema: dict[str, object]) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client_for(two_stages).chat.completions.create(
            model=two_stages.model,
            messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}},
        )
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["param"] == "response_format.json_schema.schema"
