"""The coordinator's sampling parameters on the wire: penalties folded into a logit bias over the tokens generated
so far, and OpenAI's logit_bias honoured end to end."""

from __future__ import annotations

from typing import Annotated

import pytest
from openai import OpenAI
from pydantic import BaseModel, Field
from strata.gateway.generation import Sampling
from strata.gateway.tokenizer import GGUFTokenizer, TokenizerSpec
from strata.gguf.header import GGUFHeader
from strata_testbed.serve import Served


@pytest.mark.parametrize(
    ("sampling", "prompt", "generated", "sent"),
    [
        pytest.param(Sampling(), frozenset({1, 2}), {7: 1}, (0.0, []), id="no repetition penalty: nothing named"),
        pytest.param(Sampling(repetition_penalty=1.3), frozenset({2, 1}), {7: 2, 1: 1}, (pytest.approx(1.3), [1, 2, 7]),
                     id="the prompt's and the generation's distinct tokens, once each"),
    ],
)  # fmt: skip
def test_a_repetition_penalty_names_the_prompt_and_generated_tokens(
    sampling: Sampling, prompt: frozenset[int], generated: dict[int, int], sent: tuple[float, list[int]]
) -> None:
    message = sampling.to_proto(generated, prompt)
    assert (message.repetition_penalty, list(message.penalized)) == sent


def test_a_repetition_penalty_changes_the_greedy_text(two_stages: Served) -> None:
    client = OpenAI(base_url=two_stages.base_url, api_key="unused", max_retries=0, timeout=60)

    def text(**extra: float) -> str:
        reply = client.completions.create(
            model=two_stages.model, prompt="Hello there", max_tokens=12, temperature=0, extra_body=extra
        )
        return reply.choices[0].text

    assert text(repetition_penalty=1.0) == text()
    assert text(repetition_penalty=5.0) != text()


@pytest.mark.parametrize(
    ("sampling", "generated", "bias"),
    [
        pytest.param(Sampling(), {7: 3}, {}, id="no penalty: no bias, whatever was generated"),
        pytest.param(Sampling(presence_penalty=0.5), {7: 3, 9: 1}, {7: -0.5, 9: -0.5},
                     id="presence: once per token generated"),
        pytest.param(Sampling(frequency_penalty=0.25), {7: 3, 9: 1}, {7: -0.75, 9: -0.25},
                     id="frequency: per time generated"),
        pytest.param(Sampling(presence_penalty=1.0, frequency_penalty=1.0, logit_bias={7: 5.0, 8: 2.0}), {7: 2},
                     {7: 2.0, 8: 2.0}, id="penalties add to the client's own bias"),
        pytest.param(Sampling(presence_penalty=-1.0), {4: 1}, {4: 1.0}, id="a negative penalty encourages"),
    ],
)  # fmt: skip
def test_penalties_become_a_bias_on_the_generated_tokens(
    sampling: Sampling, generated: dict[int, int], bias: dict[int, float]
) -> None:
    assert dict(sampling.to_proto(generated).logit_bias) == pytest.approx(bias)


@pytest.mark.parametrize(
    ("logit_bias", "token"),
    [
        pytest.param({"321": 100}, 321, id="a bias of +100 makes one token every greedy pick"),
        pytest.param({str(t): -100 for t in range(1000) if t != 42}, 42, id="-100 on every other token leaves one"),
    ],
)
def test_a_logit_bias_steers_the_greedy_text(
    two_stages: Served, qwen2_header: GGUFHeader, logit_bias: dict[str, int], token: int
) -> None:
    client = OpenAI(base_url=two_stages.base_url, api_key="unused", max_retries=0, timeout=60)
    tokenizer = GGUFTokenizer(TokenizerSpec.from_metadata(qwen2_header.metadata))
    reply = client.completions.create(
        model=two_stages.model, prompt="Hello", max_tokens=6, temperature=0, logit_bias=logit_bias
    )
    assert reply.choices[0].text == tokenizer.decode([token] * 6)


def test_n_choices_come_back_each_sampled_on_its_own(two_stages: Served) -> None:
    client = OpenAI(base_url=two_stages.base_url, api_key="unused", max_retries=0, timeout=60)

    def choices(seed: int) -> tuple[list[str], int]:
        reply = client.completions.create(
            model=two_stages.model, prompt="Once upon a time", max_tokens=8, temperature=1.0, n=2, seed=seed
        )
        assert [c.index for c in reply.choices] == [0, 1]
        assert reply.usage is not None
        return [c.text for c in reply.choices], reply.usage.completion_tokens

    texts, completion_tokens = choices(11)
    assert texts[0] != texts[1]
    assert choices(11) == (texts, completion_tokens)  # seeded: the same choices again
    assert completion_tokens <= 16


def test_n_parsed_choices_each_follow_the_schema(two_stages: Served) -> None:
    class Answer(BaseModel):
        ok: bool
        size: Annotated[int, Field(ge=0, le=9)]

    client = OpenAI(base_url=two_stages.base_url, api_key="unused", max_retries=0, timeout=60)
    reply = client.chat.completions.parse(
        model=two_stages.model, messages=[{"role": "user", "content": "JSON"}], response_format=Answer, n=2, seed=1
    )
    assert len(reply.choices) == 2
    assert all(isinstance(c.message.parsed, Answer) for c in reply.choices)


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_n_streamed_choices_carry_the_same_text_as_unstreamed(two_stages: Served, api: str) -> None:
    client = OpenAI(base_url=two_stages.base_url, api_key="unused", max_retries=0, timeout=60)
    common = {"model": two_stages.model, "max_tokens": 8, "temperature": 1.0, "n": 2, "seed": 5}
    texts: dict[int, str] = {0: "", 1: ""}
    reasons: dict[int, str] = {}
    if api == "completions":
        whole = [c.text for c in client.completions.create(prompt="Once upon a time", **common).choices]  # type: ignore[call-overload]
        for chunk in client.completions.create(prompt="Once upon a time", stream=True, **common):  # type: ignore[call-overload]
            for c in chunk.choices:
                texts[c.index] += c.text
                if c.finish_reason:
                    reasons[c.index] = c.finish_reason
    else:
        messages = [{"role": "user", "content": "Tell me a story."}]
        reply = client.chat.completions.create(messages=messages, **common)  # type: ignore[call-overload]
        whole = [c.message.content for c in reply.choices]
        for chunk in client.chat.completions.create(messages=messages, stream=True, **common):  # type: ignore[call-overload]
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
                if c.finish_reason:
                    reasons[c.index] = c.finish_reason
    assert [texts[0], texts[1]] == whole
    assert set(reasons) == {0, 1}
