"""Which OpenAI request fields the gateway honours and which it refuses: nothing a client sends is silently ignored.

A field the gateway does not act on changes what OpenAI would have answered (n=3 asks for three choices, `audio` for
speech), so taking it and answering as if it were absent gives the client different results without a word. Every
field of the chat-completions and completions APIs, of the request and of each message role, is in exactly one of
two tables here (tests walk the pinned `openai` package's request types to keep it so): honoured, meaning the
request models read it and the gateway does what it asks, or refused, meaning a 400 whose `param` names it unless
its value is one that asks for nothing (null, or the default it would have: n=1, store=false). A field in neither
table is unknown, and refused the same way, so a newer client's parameter is never dropped on the floor.

Fields that only label a request for the caller's own bookkeeping (`user`, `metadata`, `safety_identifier`) are
honoured: they ask for no behaviour, so answering without them is exactly what was asked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from strata.gateway.errors import InvalidRequestError


@dataclass(frozen=True)
class Refused:
    why: str
    no_op: tuple[object, ...] = ()  # values that ask for nothing (besides null), so they pass

    def accepts(self, value: object) -> bool:
        return value is None or any(value == v and type(value) is type(v) for v in self.no_op)


def _no_op(*values: object) -> tuple[object, ...]:
    # 0 and 0.0 are both the default of a float field; JSON does not say which a client meant.
    return values + tuple(float(v) for v in values if type(v) is int)


@dataclass(frozen=True)
class Fields:
    """One request shape: the fields it honours and those it refuses (with why)."""

    honoured: frozenset[str]
    refused: Mapping[str, Refused] = field(default_factory=dict)

    def check(self, given: Mapping[str, Any], *, prefix: str = "") -> None:
        """400 naming the first field in `given` that is refused with a value that asks for something, or unknown."""
        for name, value in given.items():
            param = f"{prefix}{name}"
            if name in self.honoured:
                continue
            refusal = self.refused.get(name)
            if refusal is None:
                raise InvalidRequestError(f"{param} is not a parameter this API knows", param=param)
            if not refusal.accepts(value):
                raise InvalidRequestError(f"{param} is not supported: {refusal.why}", param=param)


_STORE = Refused("nothing is stored; leave it unset or false", _no_op(False))
_SERVICE_TIER = Refused("there is one service tier; leave it unset, auto or default", ("auto", "default"))

# llama-server's and vLLM's extensions, in no OpenAI type: sampling ones honoured where they are cheap, and vLLM's
# cache_salt (a tenant's prompts reuse cached prefixes of that tenant's only).
EXTENSIONS = frozenset({"top_k", "min_p", "repetition_penalty", "cache_salt"})
_COMMON_HONOURED = (
    frozenset({"model", "max_tokens", "temperature", "top_p", "stream", "stream_options", "stop", "seed", "user"})
    | {"logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "n"}
    | EXTENSIONS
)

CHAT = Fields(
    honoured=_COMMON_HONOURED
    | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools", "tool_choice"}
    | {"parallel_tool_calls"}
    | {"metadata", "safety_identifier", "prompt_cache_key"},
    refused={
        "functions": Refused("the deprecated functions API is not supported; it was replaced by tools", ((),)),
        "function_call": Refused("the deprecated functions API is not supported; it was replaced by tools", ("none",)),
        "audio": Refused("the model writes text only"),
        "modalities": Refused("the model writes text only", (["text"],)),
        "prediction": Refused("predicted outputs are not supported"),
        "web_search_options": Refused("there is no web search"),
        "reasoning_effort": Refused("the served model has no reasoning-effort setting"),
        "verbosity": Refused("the served model has no verbosity setting"),
        "store": _STORE,
        "service_tier": _SERVICE_TIER,
        "prompt_cache_retention": Refused("the prefix cache keeps what fits; its retention is not set per request"),
        "prompt_cache_options": Refused("the prefix cache is automatic and takes no options"),
        "moderation": Refused("there is no moderation"),
    },
)

COMPLETION = Fields(
    honoured=_COMMON_HONOURED | {"prompt"},
    refused={
        "best_of": Refused("one candidate per request (best_of=1)", _no_op(1)),
        "echo": Refused("the prompt is not echoed; leave it false", _no_op(False)),
        "suffix": Refused("insertion after a suffix is not supported", ("",)),
    },
)

_MESSAGE_HONOURED = frozenset({"role", "content"})
_NAME = Refused("participant names are not passed to the chat template")

# Per role: what a message of that role may carry.
MESSAGES: Mapping[str, Fields] = {
    "system": Fields(honoured=_MESSAGE_HONOURED, refused={"name": _NAME}),
    "developer": Fields(honoured=_MESSAGE_HONOURED, refused={"name": _NAME}),
    "user": Fields(honoured=_MESSAGE_HONOURED, refused={"name": _NAME}),
    "tool": Fields(honoured=_MESSAGE_HONOURED | {"tool_call_id"}),
    "assistant": Fields(
        honoured=_MESSAGE_HONOURED | {"tool_calls"},
        refused={
            "name": _NAME,
            "function_call": Refused("the deprecated functions API is not supported; it was replaced by tools"),
            "audio": Refused("the model writes text only"),
            "refusal": Refused("a refusal is not passed to the chat template; give it as content"),
        },
    ),
}
REFUSED_ROLES: Mapping[str, str] = {
    "function": "the deprecated functions API is not supported; it was replaced by tools",
}


def check_message(index: int, message: Mapping[str, Any]) -> None:
    """400 naming the first thing in messages[index] the gateway would not pass on faithfully."""
    prefix = f"messages.{index}."
    role = message.get("role")
    fields = MESSAGES.get(role) if isinstance(role, str) else None
    if fields is None:
        why = REFUSED_ROLES.get(role, "not a role this API knows") if isinstance(role, str) else "a role is required"
        raise InvalidRequestError(f"{prefix}role {role!r} is not supported: {why}", param=f"{prefix}role")
    fields.check(message, prefix=prefix)
