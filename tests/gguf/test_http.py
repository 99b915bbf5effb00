"""Inspecting over HTTP reads about the header's size through Range requests from a real local server."""

from __future__ import annotations

from pathlib import Path

import pytest
from strata.gguf import RangeNotSupportedError, SourceError, inspect_model, read_model_header
from strata.gguf.sources import resolve_hf
from strata.gguf.testmodels import WrittenModel, write_header_only_model
from strata_testbed.range_server import serve_directory


@pytest.fixture(scope="module")
def large_model(tmp_path_factory: pytest.TempPathFactory) -> WrittenModel:
    """The Llama-3-70B-like header in a sparse file as large as the real model (about 45 GB, no disk used)."""
    root = tmp_path_factory.mktemp("served")
    return write_header_only_model(root / "model.gguf", shape="llama3-70b", full_size=True)


def test_a_70b_model_inspects_in_a_few_range_requests(large_model: WrittenModel) -> None:
    local = inspect_model(str(large_model.path))
    with serve_directory(large_model.path.parent) as server:
        header, size = read_model_header(f"{server.url}/model.gguf")
        remote = inspect_model(f"{server.url}/model.gguf")
        sent_for_one_read = server.log.bytes_sent / 2
    assert size == large_model.path.stat().st_size > 40 * 10**9
    assert remote == local
    assert remote.header_bytes_read == header.bytes_fetched == sent_for_one_read
    assert header.tensor_info_end <= header.bytes_fetched < 2 * header.tensor_info_end + 64 * 1024
    assert header.requests <= 10
    assert all(request["range"].startswith("bytes=") for request in server.log.requests)


def test_a_server_without_range_support_is_refused_without_a_download(large_model: WrittenModel) -> None:
    with serve_directory(large_model.path.parent, ranges=False) as server:
        with pytest.raises(RangeNotSupportedError, match="refusing to download"):
            inspect_model(f"{server.url}/model.gguf")
        assert server.log.bytes_sent < 2**30


@pytest.mark.parametrize(
    ("source", "endpoint", "url"),
    [
        pytest.param("hf://org/repo/model.gguf", None, "https://huggingface.co/org/repo/resolve/main/model.gguf",
                     id="without a revision the main branch is read from huggingface.co"),
        pytest.param("hf://org/repo/q4/model.gguf@v1.0", "http://mirror:8080/",
                     "http://mirror:8080/org/repo/resolve/v1.0/q4/model.gguf",
                     id="a revision and a nested path go to the configured endpoint"),
        pytest.param("hf://org/repo/model.gguf@refs/pr/1", None,
                     "https://huggingface.co/org/repo/resolve/refs%2Fpr%2F1/model.gguf",
                     id="a pull-request revision is escaped as one path segment"),
    ],
)  # fmt: skip
def test_hf_sources_resolve_to_resolve_urls(
    monkeypatch: pytest.MonkeyPatch, source: str, endpoint: str | None, url: str
) -> None:
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    if endpoint is not None:
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
    assert resolve_hf(source) == url


@pytest.mark.parametrize(
    "source",
    [
        pytest.param("hf://org/model.gguf", id="an hf source without a repository is refused"),
        pytest.param("hf://org//model.gguf", id="an hf source with an empty part is refused"),
    ],
)
def test_malformed_hf_sources_are_refused(source: str) -> None:
    with pytest.raises(SourceError):
        resolve_hf(source)


def test_hf_sources_send_the_token_and_never_show_it(
    large_model: WrittenModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    served = tmp_path / "org" / "repo" / "resolve" / "v2"
    served.mkdir(parents=True)
    (served / "model.gguf").hardlink_to(large_model.path)
    token = "hf_secret_value_123"
    monkeypatch.setenv("HF_TOKEN", token)
    with serve_directory(tmp_path) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        info = inspect_model("hf://org/repo/model.gguf@v2")
        with pytest.raises(SourceError) as missing:
            inspect_model("hf://org/repo/missing.gguf")
    assert info.block_count == large_model.shape.block_count
    assert {request.get("authorization") for request in server.log.requests} == {f"Bearer {token}"}
    assert "404" in str(missing.value)
    assert token not in str(missing.value)
