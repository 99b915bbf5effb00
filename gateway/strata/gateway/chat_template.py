"""Rendering the model's chat template: untrusted Jinja from the GGUF file, in an immutable sandbox.

A template is code that came with a downloaded file. jinja2's ImmutableSandboxedEnvironment refuses attribute
access to Python internals (`__class__`, `__subclasses__`, a function's globals) and any call that mutates a list or
dict, so a template can format messages and nothing else. The environment keeps only the globals templates use
(range, dict, namespace, raise_exception, strftime_now) and Jinja's own filters plus `tojson`; whatever a template
does wrong, the request fails with ChatTemplateError and nothing it reached for ran.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from jinja2 import TemplateError, Undefined
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from strata.gateway.errors import ChatTemplateError

MAX_RENDERED_CHARS = 4 << 20  # a template that writes more than this is looping, not formatting


class _RaisedByTemplate(TemplateError):
    pass


def _raise_exception(message: str) -> NoReturn:
    raise _RaisedByTemplate(message)


def _strftime_now(fmt: str) -> str:
    return dt.datetime.now(dt.UTC).strftime(fmt)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


class ChatTemplate:
    def __init__(self, source: str, *, bos_token: str, eos_token: str) -> None:
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, autoescape=False, undefined=Undefined, keep_trailing_newline=True
        )
        kept = {name: environment.globals[name] for name in ("range", "dict", "namespace")}
        environment.globals.clear()  # no cycler, joiner or lipsum: objects whose internals a payload would walk
        environment.globals.update(kept, raise_exception=_raise_exception, strftime_now=_strftime_now)
        environment.filters["tojson"] = _tojson
        self._bos_token = bos_token
        self._eos_token = eos_token
        try:
            self._template = environment.from_string(source)
        except TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template does not compile: {exc}") from None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The prompt; `tools` (OpenAI's shape, as HF's templates take them) only when given, so a template's
        `tools is defined` checks read true only then."""
        extra = {} if tools is None else {"tools": [dict(t) for t in tools]}
        try:
            text = self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_token,
                eos_token=self._eos_token,
                **extra,
            )
        except SecurityError as exc:
            raise ChatTemplateError(f"the model's chat template tried to leave its sandbox: {exc}") from None
        except _RaisedByTemplate as exc:
            raise ChatTemplateError(f"the model's chat template refused the messages: {exc}") from None
        except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError, RecursionError) as exc:
            raise ChatTemplateError(f"the model's chat template failed: {type(exc).__name__}: {exc}") from None
        if len(text) > MAX_RENDERED_CHARS:
            raise ChatTemplateError(f"the model's chat template wrote more than {MAX_RENDERED_CHARS} characters")
        return text
