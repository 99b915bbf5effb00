"""Tool calls: how each model family is shown tools and writes calls, and how a call is read back out of its text.

A GGUF's chat template says whether the model knows tools: rendered with a probe tool, a template that knows them
writes the tool out, in its family's own words. Which family is read off that rendering (one table of markers, as
llama.cpp's chat handlers pick theirs): Hermes/Qwen (`<tool_call>{json}</tool_call>`), Llama 3.x (a JSON object
with "name" and "parameters"), Mistral (`[TOOL_CALLS][{json}, ...]`). A template that writes nothing of the probe
tool gets the generic format instead: the tools described in a system message, and the whole reply one JSON object,
`{"tool_calls": [...]}` or `{"response": "..."}`, enforced by grammar, as llama.cpp's generic handler does.

`tool_choice` "required" or a named function is enforced by grammar in every format (strata.gateway.grammar), so a
call comes out on any weights and its arguments are valid for the function's schema; "auto" lets a native-format
model write text or calls, and reads back what it wrote; "none" shows no tools and reads back nothing.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ANY_ARGUMENTS: Mapping[str, Any] = {"type": "object"}
PROBE_TOOL = "strata_probe_tool_7f3a"
MAX_PARALLEL_CALLS = 4  # a forced reply ends on any weights: at most this many calls, then the end
MISTRAL_MARKER = "[TOOL_CALLS]"
COMPACT = {"whitespace_flexible": False}  # as strata.gateway.grammar's JSON: no whitespace to run on with


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str | None
    parameters: Mapping[str, Any]


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it

    @staticmethod
    def new_id() -> str:
        return f"call_{uuid.uuid4().hex[:24]}"


def _embedded(schema: Mapping[str, Any]) -> str:
    """A JSON schema as a Lark rule's %json body, compact like every JSON the gateway constrains."""
    return json.dumps({"x-guidance": COMPACT, **schema})


def _repeat(item: str, separator: str, parallel: bool) -> str:
    return f"{item} ({separator} {item}){{0,{MAX_PARALLEL_CALLS - 1}}}" if parallel else item


def _bounded(parallel: bool) -> dict[str, int]:
    return {"minItems": 1, "maxItems": MAX_PARALLEL_CALLS if parallel else 1}


def _call_schema(tools: Sequence[ToolSpec], *, arguments_key: str) -> dict[str, Any]:
    """One call of any of `tools`: {"name": <its name>, arguments_key: <its parameters>}."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, arguments_key: dict(t.parameters)},
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _calls_from_json(value: Any, *, arguments_key: str) -> list[ParsedCall] | None:
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get(arguments_key, item.get("arguments", {}))
        calls.append(ParsedCall(name=item["name"], arguments=json.dumps(arguments, ensure_ascii=False)))
    return calls


def _json_prefix(text: str) -> tuple[Any, str] | None:
    """The JSON value at the start of `text` and the rest, or None."""
    try:
        value, end = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError:
        return None
    return value, text[end:]


@dataclass(frozen=True)
class ToolFormat:
    name: str
    marker: str  # what the template writes when it shows tools; "" for the generic format
    native: bool  # the template renders tools itself
    # Lark grammar of one or more calls, from (tools, parallel, the vocabulary's special tokens by text).
    forced: Callable[[Sequence[ToolSpec], bool, Mapping[str, int]], str]
    parse: Callable[[str], tuple[str, list[ParsedCall]]]  # the reply's text -> (content, calls)


def _hermes_forced(tools: Sequence[ToolSpec], parallel: bool, specials: Mapping[str, int]) -> str:
    schema = _embedded(_call_schema(tools, arguments_key="arguments"))
    start = _repeat("block", '"\\n"', parallel)
    return f'start: {start}\nblock: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {schema}'


_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _hermes_parse(text: str) -> tuple[str, list[ParsedCall]]:
    calls: list[ParsedCall] = []
    for body in _HERMES_CALL.findall(text):
        found = _json_prefix(body)
        parsed = _calls_from_json(found[0], arguments_key="arguments") if found else None
        if parsed is None:
            return text, []  # a malformed call is left as text rather than guessed at
        calls += parsed
    return (_HERMES_CALL.sub("", text).strip(), calls) if calls else (text, [])


def _llama3_forced(tools: Sequence[ToolSpec], parallel: bool, specials: Mapping[str, int]) -> str:
    schema = _embedded(_call_schema(tools, arguments_key="parameters"))
    start = _repeat("call", '"; "', parallel)
    return f"start: {start}\ncall: %json {schema}"


def _llama3_parse(text: str) -> tuple[str, list[ParsedCall]]:
    body = text.strip().removeprefix("<|python_tag|>")
    calls: list[ParsedCall] = []
    for part in body.split(";"):
        found = _json_prefix(part.strip())
        parsed = _calls_from_json(found[0], arguments_key="parameters") if found and not found[1].strip() else None
        if parsed is None:
            return text, []
        calls += parsed
    return "", calls


def _mistral_forced(tools: Sequence[ToolSpec], parallel: bool, specials: Mapping[str, int]) -> str:
    schema = _call_schema(tools, arguments_key="arguments")
    array = {"type": "array", "items": schema, **_bounded(parallel)}
    # Mistral's tokenizers hold [TOOL_CALLS] as one special token: the grammar asks for that token, as the model
    # writes it, rather than for its text spelled out in ordinary tokens.
    marker = f"<[{specials[MISTRAL_MARKER]}]>" if MISTRAL_MARKER in specials else json.dumps(MISTRAL_MARKER)
    return f"start: {marker} calls\ncalls: %json {_embedded(array)}"


def _mistral_parse(text: str) -> tuple[str, list[ParsedCall]]:
    before, marker, after = text.partition(MISTRAL_MARKER)
    found = _json_prefix(after.strip()) if marker else None
    calls = _calls_from_json(found[0], arguments_key="arguments") if found else None
    return (before.strip(), calls) if calls else (text, [])


def generic_schema(tools: Sequence[ToolSpec], *, parallel: bool, required: bool) -> dict[str, Any]:
    """The generic format's whole reply: calls, or (when not required) a plain response."""
    calls = {
        "type": "array",
        "items": _call_schema(tools, arguments_key="arguments"),
        **_bounded(parallel),
    }
    with_calls = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"]}
    if required:
        return with_calls | {"additionalProperties": False}
    response = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"]}
    return {"anyOf": [with_calls | {"additionalProperties": False}, response | {"additionalProperties": False}]}


def _generic_forced(tools: Sequence[ToolSpec], parallel: bool, specials: Mapping[str, int]) -> str:
    return f"start: %json {_embedded(generic_schema(tools, parallel=parallel, required=True))}"


def _generic_parse(text: str) -> tuple[str, list[ParsedCall]]:
    found = _json_prefix(text.strip())
    if found is None or not isinstance(found[0], dict):
        return text, []
    value = found[0]
    if isinstance(value.get("response"), str):
        return value["response"], []
    calls = _calls_from_json(value.get("tool_calls"), arguments_key="arguments")
    return ("", calls) if calls else (text, [])


HERMES = ToolFormat("hermes", "<tool_call>", True, _hermes_forced, _hermes_parse)
LLAMA3 = ToolFormat("llama3", "Environment: ipython", True, _llama3_forced, _llama3_parse)
MISTRAL = ToolFormat("mistral", "[AVAILABLE_TOOLS]", True, _mistral_forced, _mistral_parse)
GENERIC = ToolFormat("generic", "", False, _generic_forced, _generic_parse)
NATIVE_FORMATS = (HERMES, MISTRAL, LLAMA3)


def format_from_probe(rendered: str | None) -> ToolFormat:
    """The format of a template, from its rendering of a conversation with the probe tool (None: it failed)."""
    if rendered is None or PROBE_TOOL not in rendered:
        return GENERIC
    return next((f for f in NATIVE_FORMATS if f.marker in rendered), GENERIC)


def probe_tools() -> list[dict[str, Any]]:
    return [openai_tool(ToolSpec(name=PROBE_TOOL, description="probe", parameters={"type": "object"}))]


def openai_tool(tool: ToolSpec) -> dict[str, Any]:
    """A tool as templates take it (HF's and llama.cpp's `tools` variable: OpenAI's own shape)."""
    function: dict[str, Any] = {"name": tool.name, "parameters": dict(tool.parameters)}
    if tool.description:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def generic_system_prompt(tools: Sequence[ToolSpec], *, parallel: bool) -> str:
    described = json.dumps([openai_tool(t)["function"] for t in tools], ensure_ascii=False, indent=2)
    many = "one or more calls" if parallel else "exactly one call"
    return (
        "You can call these tools:\n"
        f"{described}\n\n"
        "Reply with one JSON object and nothing else: either "
        '{"tool_calls": [{"name": <tool name>, "arguments": <arguments object>}]} '
        f"with {many}, or "
        '{"response": <your answer as a string>}.'
    )


def generic_call_text(calls: Sequence[tuple[str, str]]) -> str:
    """An earlier assistant turn's calls (name, JSON arguments) as the generic format writes them."""
    return json.dumps(
        {"tool_calls": [{"name": name, "arguments": _loads_or_text(arguments)} for name, arguments in calls]},
        ensure_ascii=False,
    )


def generic_tool_result(tool_name: str, content: str) -> str:
    """A tool's result as the generic format shows it: under the tool's name, which the model knows from the system
    message (a call id is noise to it, and a random one would make the prompt differ from run to run)."""
    return json.dumps({"tool_response": {"tool": tool_name, "content": content}}, ensure_ascii=False)


def _loads_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def template_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """An earlier assistant turn's call as native templates read it: arguments as an object (Qwen's and Llama's
    templates write `arguments | tojson`, which would quote a string again)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": _loads_or_text(arguments)}}
