"""Each cause of an unreadable model is its own Planned reason with a message a person can act on, read from real
sources (local files, a local HTTP server, a closed port, a name that does not resolve, TLS to a plain port)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from strata.gguf.testmodels.writer import write_header_only_model
from strata.operator.models import ModelCache, ModelUnreadable
from strata.operator.reasons import Reason
from strata_testbed.bad_models import closed_port, serve_refusals, write_bad_headers
from strata_testbed.range_server import serve_directory


@dataclass(frozen=True)
class Sources:
    refusals: str  # base URL of the server that refuses
    no_range: str  # base URL of a server that ignores Range
    files: dict[str, Path]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sources]:
    folder = tmp_path_factory.mktemp("bad")
    whole = write_header_only_model(folder / "model.gguf", shape="llama3-8b").path
    files = write_bad_headers(folder, whole=whole)
    with serve_refusals() as refusals, serve_directory(folder, ranges=False) as no_range:
        yield Sources(refusals=refusals, no_range=no_range.url, files=files)


Case = tuple[Callable[[Sources], str], str | None, Reason, str]
CASES: list[Case] = [
    (lambda s: f"{s.refusals}/missing.gguf", None, Reason.MODEL_NOT_FOUND, "no such file (HTTP 404 Not Found)"),
    (lambda s: f"{s.refusals}/private.gguf", "wrong", Reason.MODEL_ACCESS_DENIED, "refused the token (HTTP 401"),
    (lambda s: f"{s.refusals}/private.gguf", None, Reason.MODEL_ACCESS_DENIED, "wants a token (HTTP 401"),
    (lambda s: "hf://org/gated/model.gguf", "hf_x", Reason.MODEL_GATED, "the repository is gated"),
    (lambda s: f"{s.refusals}/busy.gguf", None, Reason.MODEL_UNREACHABLE, "unavailable (HTTP 503"),
    (lambda s: f"http://127.0.0.1:{closed_port()}/m.gguf", None, Reason.MODEL_UNREACHABLE, "refused the connection"),
    (lambda s: "http://strata-no-such-host.invalid/m.gguf", None, Reason.MODEL_UNREACHABLE, "does not resolve"),
    (lambda s: s.refusals.replace("http:", "https:") + "/m.gguf", None, Reason.MODEL_TLS_FAILED, "TLS handshake"),
    (lambda s: f"{s.no_range}/model.gguf", None, Reason.MODEL_RANGE_IGNORED, "ignored the Range request"),
    (lambda s: s.files["not-gguf"].as_uri(), None, Reason.MODEL_NOT_GGUF, "magic at byte 0"),
    (lambda s: s.files["truncated"].as_uri(), None, Reason.MODEL_HEADER_TRUNCATED, "at byte"),
    (lambda s: s.files["hostile"].as_uri(), None, Reason.MODEL_HEADER_INVALID, "tensor_count at byte 8"),
    (lambda s: "file:///nowhere/model.gguf", None, Reason.MODEL_NOT_FOUND, "/nowhere/model.gguf: no such file"),
]
IDS = [
    "a URL that 404s is ModelNotFound",
    "a wrong token is ModelAccessDenied",
    "no token where one is wanted is ModelAccessDenied",
    "a gated Hugging Face repository is ModelGated",
    "a server answering 503 is ModelUnreachable",
    "a refused connection is ModelUnreachable",
    "a host name that does not resolve is ModelUnreachable",
    "TLS to a server that does not speak it is ModelTLSFailed",
    "a server that ignores Range is ModelRangeIgnored",
    "a file that is not GGUF is ModelNotGGUF",
    "a file cut inside its header is ModelHeaderTruncated",
    "a header claiming 2^60 tensors is ModelHeaderInvalid",
    "a missing local file is ModelNotFound",
]


@pytest.mark.parametrize(("url", "token", "reason", "said"), CASES, ids=IDS)
def test_each_cause_of_an_unreadable_model_has_its_reason_and_a_plain_message(
    sources: Sources,
    monkeypatch: pytest.MonkeyPatch,
    url: Callable[[Sources], str],
    token: str | None,
    reason: Reason,
    said: str,
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", sources.refusals)
    with pytest.raises(ModelUnreadable) as raised:
        ModelCache().inspect(url(sources), token=token)
    message = str(raised.value)
    assert raised.value.reason == reason
    assert said in message
    assert "developer.mozilla.org" not in message
    assert "For more information" not in message
    assert message.count("\n") == 0
    if token:
        assert token not in message
