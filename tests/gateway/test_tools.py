"""Tool-call formats: which one a chat template speaks, reading calls back out of replies, and forced calls that
come out whole on any weights.

The templates here are small ones written for the test, each showing tools the way its family's real template does
(the marker the format is recognised by); the forced-call grammars are walked with random allowed tokens over the
generated model's vocabulary, as random weights would pick them.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from strata.gateway.chat_template import ChatTemplate
from strata.gateway.grammar import Grammars
from strata.gateway.tokenizer import GGUFTokenizer, TokenizerSpec
from strata.gateway.tools import (
    GENERIC,
    HERMES,
    LLAMA3,
    MISTRAL,
    ToolFormat,
    ToolSpec,
    format_from_probe,
    probe_tools,
)
from strata.gguf import read_model_header
from strata.gguf.testmodels.vocabulary import CHAT_TEMPLATE

_MESSAGES = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
TEMPLATES = [
    pytest.param(CHAT_TEMPLATE, GENERIC, id="a template that knows nothing of tools is generic"),
    pytest.param(
        "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools> Call them inside "
        "<tool_call></tool_call> tags.{% endif %}" + _MESSAGES,
        HERMES,
        id="a Hermes/Qwen template",
    ),
    pytest.param(
        "{% if tools is defined %}Environment: ipython\n{% for t in tools %}{{ t.function | tojson }}{% endfor %}"
        "{% endif %}" + _MESSAGES,
        LLAMA3,
        id="a Llama 3.x template",
    ),
    pytest.param(
        "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}" + _MESSAGES,
        MISTRAL,
        id="a Mistral template",
    ),
    pytest.param(
        "{% if tools %}Tools: {{ tools | tojson }}{% endif %}" + _MESSAGES,
        GENERIC,
        id="a template that shows tools in words no family uses is generic",
    ),
    pytest.param(
        "{% if tools %}{{ raise_exception('no tools here') }}{% endif %}" + _MESSAGES,
        GENERIC,
        id="a template that refuses tools is generic",
    ),
]


@pytest.mark.parametrize(("source", "expected"), TEMPLATES)
def test_the_format_is_read_from_how_the_template_shows_a_probe_tool(source: str, expected: ToolFormat) -> None:
    template = ChatTemplate(source, bos_token="", eos_token="")
    try:
        rendered: str | None = template.render([{"role": "user", "content": "hi"}], tools=probe_tools())
    except Exception:
        rendered = None
    assert format_from_probe(rendered) is expected


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
PARSED = [
    pytest.param(HERMES, 'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
                 "Let me look.", [("weather", {"city": "Oslo"})], id="Hermes: text, then a call"),
    pytest.param(HERMES, '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", '
                 '"arguments": {"x": 1}}</tool_call>', "", [("a", {}), ("b", {"x": 1})], id="Hermes: two calls"),
    pytest.param(HERMES, "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", [],
                 id="Hermes: a malformed call stays text"),
    pytest.param(LLAMA3, '{"name": "weather", "parameters": {"city": "Oslo"}}', "", [("weather", {"city": "Oslo"})],
                 id="Llama 3: a JSON call with parameters"),
    pytest.param(LLAMA3, '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 2}}', "",
                 [("a", {}), ("b", {"x": 2})], id="Llama 3: calls after the python tag, separated by ;"),
    pytest.param(LLAMA3, "The weather is fine.", "The weather is fine.", [], id="Llama 3: plain text"),
    pytest.param(MISTRAL, '[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Oslo"}}]', "",
                 [("weather", {"city": "Oslo"})], id="Mistral: a call list after the marker"),
    pytest.param(GENERIC, '{"tool_calls": [{"name": "weather", "arguments": {"city": "Oslo"}}]}', "",
                 [("weather", {"city": "Oslo"})], id="generic: calls"),
    pytest.param(GENERIC, '{"response": "It is sunny."}', "It is sunny.", [], id="generic: a response"),
]  # fmt: skip


@pytest.mark.parametrize(("tool_format", "text", "content", "calls"), PARSED)
def test_calls_are_read_back_out_of_the_reply(
    tool_format: ToolFormat, text: str, content: str, calls: list[tuple[str, dict[str, object]]]
) -> None:
    got_content, got = tool_format.parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


@pytest.fixture(scope="module")
def grammars(tmp_path_factory: pytest.TempPathFactory) -> tuple[Grammars, GGUFTokenizer]:
    from strata.gguf.testmodels import write_test_model

    path: Path = write_test_model(tmp_path_factory.mktemp("tools") / "m.gguf", architecture="qwen2", block_count=1).path
    tokenizer = GGUFTokenizer(TokenizerSpec.from_metadata(read_model_header(str(path))[0].metadata))
    return Grammars(tokenizer), tokenizer


TOOLS = (
    ToolSpec(name="weather", description=None, parameters={
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
        "additionalProperties": False}),
    ToolSpec(name="add", description=None, parameters={
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                          "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}),
)  # fmt: skip


@pytest.mark.parametrize("tool_format", [HERMES, LLAMA3, MISTRAL, GENERIC], ids=lambda f: f.name)
@pytest.mark.parametrize("parallel", [False, True], ids=["one call", "parallel calls"])
def test_a_forced_call_comes_out_whole_on_random_picks(
    grammars: tuple[Grammars, GGUFTokenizer], tool_format: ToolFormat, parallel: bool
) -> None:
    compiled, tokenizer = grammars
    grammar = compiled.lark(tool_format.forced(TOOLS, parallel, {}), param="tools")
    stops = tokenizer.stop_ids
    for seed in range(8):
        rng = random.Random(seed)  # noqa: S311  # random weights, not secrets
        constraint = compiled.start(grammar)
        ids: list[int] = []
        while not constraint.complete and len(ids) < 300:
            mask = constraint.mask()
            allowed = [i for i in range(tokenizer.vocab_size) if mask[i // 8] >> (i % 8) & 1]
            token = rng.choice(allowed)
            if token in stops:
                break
            constraint.advance(token)
            ids.append(token)
        text = tokenizer.decode(ids, skip_special=False)
        _content, calls = tool_format.parse(text)
        assert calls, f"{text!r} holds no call"
        assert parallel or len(calls) == 1
        for call in calls:
            arguments = json.loads(call.arguments)
            assert (call.name, tuple(sorted(arguments))) in {("weather", ("city",)), ("add", ("a", "b"))}, text


def test_a_mistral_call_starts_with_the_special_token_where_the_vocabulary_has_one(
    grammars: tuple[Grammars, GGUFTokenizer],
) -> None:
    compiled, tokenizer = grammars
    # The generated vocabulary has no [TOOL_CALLS]: lend its text to one of the special tokens it has.
    marker_id = min(tokenizer.special_ids - tokenizer.stop_ids)
    grammar = compiled.lark(MISTRAL.forced(TOOLS, False, {"[TOOL_CALLS]": marker_id}), param="tools")
    mask = compiled.start(grammar).mask()
    allowed = [i for i in range(tokenizer.vocab_size) if mask[i // 8] >> (i % 8) & 1]
    assert allowed == [marker_id]
