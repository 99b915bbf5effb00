"""Fixtures for the gateway: `strata serve` as a real process tree on loopback, and in-process apps without stages."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from strata.gguf import read_model_header
from strata.gguf.header import GGUFHeader
from strata.gguf.testmodels import write_test_model
from strata_testbed.serve import Served, strata_serve

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gateway-models")


@pytest.fixture(scope="session")
def qwen2_model(model_dir: Path) -> Path:
    """Four layers, so two stages take two each."""
    return write_test_model(model_dir / "qwen2.gguf", architecture="qwen2", block_count=4).path


@pytest.fixture(scope="session")
def two_stages(qwen2_model: Path) -> Iterator[Served]:
    with strata_serve(str(qwen2_model), "--stages", "2", "--parallel", "2", "--context", "1024") as served:
        yield served


@pytest.fixture(scope="session")
def one_stage(qwen2_model: Path) -> Iterator[Served]:
    with strata_serve(str(qwen2_model), "--stages", "1", "--parallel", "2", "--context", "1024") as served:
        yield served


@pytest.fixture(scope="session")
def three_stages(qwen2_model: Path) -> Iterator[Served]:
    with strata_serve(str(qwen2_model), "--stages", "3", "--parallel", "2", "--context", "1024") as served:
        yield served


@pytest.fixture(scope="session")
def one_lane(qwen2_model: Path) -> Iterator[Served]:
    """One lane, one waiting place, a one-second wait: what the admission tests probe."""
    args = ("--parallel", "1", "--queue-per-lane", "1", "--max-wait-seconds", "1", "--context", "4096")
    with strata_serve(str(qwen2_model), *args) as served:
        yield served


@pytest.fixture(scope="session")
def qwen2_header(qwen2_model: Path) -> GGUFHeader:
    return read_model_header(str(qwen2_model))[0]
