"""Fixtures of the operator's tests on the test bed: a namespace per test, the models (tests/conftest.py installs the
CRD)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client
from strata.gguf.testmodels.shapes import LARGE_SHAPES
from strata.gguf.testmodels.writer import write_header_only_model
from strata_testbed.waiting import fresh_namespace


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("models")
    big = dataclasses.replace(LARGE_SHAPES["llama3-70b"], name="Larger-than-the-pool", block_count=8000)
    return {
        "70b": write_header_only_model(folder / "llama3-70b.gguf", shape="llama3-70b").path,
        "too-big": write_header_only_model(folder / "too-big.gguf", shape=big).path,
    }


@pytest.fixture
def namespace(cluster: client.ApiClient) -> Iterator[str]:
    with fresh_namespace(cluster, "op") as name:
        yield name
