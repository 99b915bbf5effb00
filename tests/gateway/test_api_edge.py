"""The HTTP edge without a pipeline: keys, body limits, readiness, and a chat template that reaches for Python.

The app is served in-process with no stage behind it, so the pipeline is never ready: everything checked here
happens before a request would take a lane.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import httpx
import pytest
from strata.gateway.chat_template import ChatTemplate
from strata.gateway.errors import ChatTemplateError
from strata.gateway.server import build
from strata.gateway.settings import GatewaySettings
from strata.gguf.header import GGUFHeader

KEY = "sk-test-key"
# TARGET becomes a path under the test's tmp_path: in a plain (unsandboxed) Jinja environment each payload that
# names it creates that file, so its absence shows the payload ran nothing.
SSTI_PAYLOADS = [
    pytest.param("{{ ''.__class__.__mro__[1].__subclasses__() }}", id="walking from a string to every class"),
    pytest.param("{{ cycler.__init__.__globals__.os.popen('touch TARGET').read() }}", id="the cycler globals trick"),
    pytest.param("{{ joiner.__init__.__globals__['os'].system('touch TARGET') }}", id="the joiner globals trick"),
    pytest.param("{{ lipsum.__globals__['os'].system('touch TARGET') }}", id="the lipsum globals trick"),
    pytest.param(
        "{{ cycler.__init__.__globals__.__builtins__.open('TARGET', 'w').write('x') }}", id="writing through open"
    ),
    pytest.param("{{ messages.__class__.__base__.__subclasses__() }}", id="walking from the messages list"),
    pytest.param("{% set x = messages.append({'role': 'system'}) %}{{ x }}", id="mutating the messages"),
    pytest.param("{{ raise_exception('no') }}", id="the template raising on purpose"),
]


def aimed(payload: str, tmp_path: Path) -> tuple[str, Path]:
    """The payload aimed at a file under tmp_path, and that file."""
    target = tmp_path / "pwned"
    return payload.replace("TARGET", str(target)), target


def call(
    header: GGUFHeader, method: str, path: str, *, keys: frozenset[str] = frozenset(), **kwargs: Any
) -> httpx.Response:
    settings = GatewaySettings(model_url="unused.gguf", first_stage="127.0.0.1:9", context=64, api_keys=keys)
    app, _serving = build(settings, header=header)

    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(send())


def chat(model: str = "strata-test-qwen2") -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        pytest.param({}, 401, id="no key is 401"),
        pytest.param({"Authorization": "Bearer sk-wrong"}, 401, id="a wrong key is 401"),
        pytest.param({"Authorization": f"Basic {KEY}"}, 401, id="the right key in the wrong scheme is 401"),
        pytest.param({"Authorization": f"Bearer {KEY}"}, 200, id="the right key passes"),
    ],
)
def test_api_keys_guard_the_v1_routes(qwen2_header: GGUFHeader, headers: dict[str, str], status: int) -> None:
    response = call(qwen2_header, "GET", "/v1/models", keys=frozenset({KEY}), headers=headers)
    assert response.status_code == status
    if status == 401:
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert KEY not in response.text


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "status", "code"),
    [
        pytest.param("POST", "/v1/chat/completions", {"json": chat()}, 503, "service_unavailable",
                     id="a request while the pipeline is not ready is 503"),
        pytest.param("POST", "/v1/chat/completions", {"json": chat("other/model:Q4")}, 404, "model_not_found",
                     id="an unknown model is 404 before readiness matters"),
        pytest.param("POST", "/v1/completions", {"content": b"x" * (9 << 20)}, 413, "request_too_large",
                     id="an oversized body is 413"),
        pytest.param("POST", "/v1/completions", {"content": b"{not json"}, 400, None,
                     id="a body that is not JSON is 400"),
        pytest.param("GET", "/v1/nothing-here", {}, 404, "not_found", id="an unknown route is an OpenAI-shaped 404"),
        pytest.param("GET", "/readyz", {}, 503, "service_unavailable", id="readiness fails until the stages answer"),
    ],
)  # fmt: skip
def test_errors_are_openai_shaped(
    qwen2_header: GGUFHeader, method: str, path: str, kwargs: dict[str, Any], status: int, code: str | None
) -> None:
    response = call(qwen2_header, method, path, **kwargs)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    if status == 503:
        assert response.headers["retry-after"] == "1"


@pytest.mark.parametrize("payload", SSTI_PAYLOADS)
def test_a_chat_template_reaching_for_python_fails_the_request_cleanly(
    qwen2_header: GGUFHeader, payload: str, tmp_path: Path
) -> None:
    payload, target = aimed(payload, tmp_path)
    metadata = dict(qwen2_header.metadata) | {"tokenizer.chat_template": payload}
    header = dataclasses.replace(qwen2_header, metadata=metadata)
    response = call(header, "POST", "/v1/chat/completions", json=chat())
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "chat_template_error"
    assert "<class" not in response.text
    assert not target.exists(), "the payload's command ran"


@pytest.mark.parametrize("payload", SSTI_PAYLOADS)
def test_the_sandbox_runs_nothing_a_payload_asks_for(payload: str, tmp_path: Path) -> None:
    payload, target = aimed(payload, tmp_path)
    template = ChatTemplate(payload, bos_token="<s>", eos_token="</s>")
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError):
        template.render(messages)
    assert messages == [{"role": "user", "content": "hi"}]
    assert not target.exists(), "the payload's command ran"


def test_the_models_own_template_renders_a_conversation(qwen2_header: GGUFHeader) -> None:
    source = qwen2_header.metadata["tokenizer.chat_template"]
    assert isinstance(source, str)
    rendered = ChatTemplate(source, bos_token="", eos_token="").render(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    )
    assert (
        rendered == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
