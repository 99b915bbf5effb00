"""A chat request's tools applied: what the template is shown, the grammar a forced call follows, and the reply
read back into OpenAI's tool_calls.

strata.gateway.tools knows the formats; this module reads the request (tools, tool_choice, parallel_tool_calls,
earlier calls and their results in the messages) and turns it into what the serving object needs, refusing with a
400 naming the parameter whatever cannot be honoured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from strata.gateway import protocol as p
from strata.gateway.chat_template import ChatTemplate
from strata.gateway.errors import ChatTemplateError, InvalidRequestError
from strata.gateway.grammar import Grammar, Grammars
from strata.gateway.tools import (
    ANY_ARGUMENTS,
    GENERIC,
    ParsedCall,
    ToolFormat,
    ToolSpec,
    format_from_probe,
    generic_call_text,
    generic_schema,
    generic_system_prompt,
    generic_tool_result,
    openai_tool,
    probe_tools,
    template_call,
)


@dataclass(frozen=True)
class ToolUse:
    """Tools in play for one request (tool_choice is not "none")."""

    format: ToolFormat
    tools: tuple[ToolSpec, ...]
    parallel: bool
    forced: tuple[ToolSpec, ...] | None  # a call to one of these must be written; None: the model may answer instead

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [openai_tool(t) for t in self.tools] if self.format.native else None

    def grammar(self, grammars: Grammars) -> Grammar | None:
        if self.forced is not None:
            return grammars.lark(self.format.forced(self.forced, self.parallel, grammars.special_ids), param="tools")
        if not self.format.native:  # the generic format is JSON either way: calls, or a response
            schema = generic_schema(self.tools, parallel=self.parallel, required=False)
            return grammars.json_schema(schema, param="tools")
        return None

    def reply(self, *, plain: str, raw: str) -> tuple[str | None, list[p.ToolCall]]:
        """The message's (content, calls). `plain` is the reply's text as it streams (special tokens left out, stop
        strings applied); `raw` has the special tokens written out, which some formats' calls start with. Where the
        reply holds no call the content is the plain text, or the generic format's response."""
        content, calls = self.format.parse(raw)
        if not self.parallel:
            calls = calls[:1]
        known = {t.name for t in self.tools}
        if not calls or any(c.name not in known for c in calls):  # a call to a tool nobody offered stays text
            return (content if not self.format.native and content != raw else plain), []
        return content or None, [_tool_call(c) for c in calls]


def _tool_call(call: ParsedCall) -> p.ToolCall:
    return p.ToolCall(id=ParsedCall.new_id(), function=p.FunctionCall(name=call.name, arguments=call.arguments))


def template_format(template: ChatTemplate | None) -> ToolFormat:
    """How a model's template shows tools, found by rendering a probe tool through it (once per model)."""
    if template is None:
        return GENERIC
    try:
        rendered = template.render([{"role": "user", "content": "hello"}], tools=probe_tools())
    except ChatTemplateError:
        return GENERIC
    return format_from_probe(rendered)


def plan(request: p.ChatCompletionRequest, tool_format: ToolFormat) -> ToolUse | None:
    """The request's tool use, or None when no tool may be called; 400 for a choice that cannot be honoured."""
    tools = tuple(
        ToolSpec(
            name=t.function.name,
            description=t.function.description,
            parameters=t.function.parameters or ANY_ARGUMENTS,
        )
        for t in request.tools or ()
    )
    choice = request.tool_choice or ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise InvalidRequestError("tool_choice asks for a call, but no tools are given", param="tool_choice")
    if len({t.name for t in tools}) != len(tools):
        raise InvalidRequestError("two tools have the same name", param="tools")
    if choice == "none":
        return None
    if request.response_format is not None and request.response_format.type != "text":
        raise InvalidRequestError(
            "response_format together with tools is not supported; use one or the other", param="response_format"
        )
    forced: tuple[ToolSpec, ...] | None = None
    if isinstance(choice, p.NamedToolChoice):
        forced = tuple(t for t in tools if t.name == choice.function.name)
        if not forced:
            missing = choice.function.name
            raise InvalidRequestError(
                f"tool_choice names {missing!r}, which is not among the tools", param="tool_choice"
            )
    elif choice == "required":
        forced = tools
    parallel = request.parallel_tool_calls is not False and not isinstance(choice, p.NamedToolChoice)
    return ToolUse(format=tool_format, tools=tools, parallel=parallel, forced=forced)


def template_messages(
    request: p.ChatCompletionRequest, use: ToolUse | None, tool_format: ToolFormat
) -> list[dict[str, Any]]:
    """The messages as the template reads them. Native formats get calls and tool results in the shape HF's
    templates take; the generic format gets them as the text it writes, results as user turns, and the tools in a
    system message."""
    names = {c.id: c.function.name for m in request.messages for c in m.tool_calls or ()}
    messages: list[dict[str, Any]] = []
    for m in request.messages:
        if tool_format.native:
            message: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.tool_calls:
                message["tool_calls"] = [
                    template_call(c.id, c.function.name, c.function.arguments) for c in m.tool_calls
                ]
            if m.tool_call_id is not None:
                message |= {"tool_call_id": m.tool_call_id, "name": names.get(m.tool_call_id, "")}
        elif m.tool_calls:
            written = generic_call_text([(c.function.name, c.function.arguments) for c in m.tool_calls])
            message = {"role": "assistant", "content": written}
        elif m.role == "tool":
            message = {"role": "user", "content": generic_tool_result(names.get(m.tool_call_id or "", ""), m.text())}
        else:
            message = {"role": m.role, "content": m.text()}
        messages.append(message)
    if use is not None and not tool_format.native:
        prompt = generic_system_prompt(use.tools, parallel=use.parallel)
        if messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{prompt}"}
        else:
            messages.insert(0, {"role": "system", "content": prompt})
    return messages
