"""The OpenAI Agents SDK against a real `strata serve`: an agent calls a function tool, the SDK runs it and sends
the result back, and the agent's next turn answers.

On random weights the first turn is steered by `tool_choice` naming the tool (the grammar makes the call whatever
the weights say) and the second by `tool_choice` "none", so the exchange is the same on every run.
"""

from __future__ import annotations

import asyncio
from typing import Literal

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    RunResult,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI
from strata_testbed.serve import Served

CALLS: list[str] = []


@function_tool
def get_weather(city: Literal["Oslo", "Paris", "Lima"]) -> str:
    """The weather in a city now."""
    CALLS.append(city)
    return f"It is 21 degrees in {city}."


def test_an_agent_calls_a_tool_and_answers_with_its_result(two_stages: Served) -> None:
    set_tracing_disabled(True)  # nothing leaves the machine
    client = AsyncOpenAI(base_url=two_stages.base_url, api_key="unused", max_retries=0, timeout=120)
    model = OpenAIChatCompletionsModel(model=two_stages.model, openai_client=client)
    caller = Agent(
        name="weather",
        instructions="Answer questions about the weather.",
        model=model,
        tools=[get_weather],
        model_settings=ModelSettings(tool_choice="get_weather", max_tokens=60, temperature=0.7),
        tool_use_behavior="stop_on_first_tool",
    )

    async def exchange() -> tuple[RunResult, RunResult]:
        first = await Runner.run(caller, "What is the weather in Oslo?")
        answerer = caller.clone(model_settings=ModelSettings(tool_choice="none", max_tokens=12, temperature=0.7),
                                tool_use_behavior="run_llm_again")  # fmt: skip
        second = await Runner.run(answerer, first.to_input_list())
        return first, second

    first, second = asyncio.run(exchange())
    assert len(CALLS) == 1
    assert CALLS[0] in ("Oslo", "Paris", "Lima")
    assert first.final_output == f"It is 21 degrees in {CALLS[0]}."
    answer = second.final_output
    assert isinstance(answer, str)
    assert answer
    kinds = [item.type for item in second.new_items]
    assert kinds == ["message_output_item"]
