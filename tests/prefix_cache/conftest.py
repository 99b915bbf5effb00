"""Fixtures for the prefix cache: generated three-layer models, so a pipeline splits into 1, 2 or 3 stages."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from strata.gguf.testmodels import write_test_model
from strata_testbed.serve import Served, strata_serve

os.environ.setdefault("HF_HUB_OFFLINE", "1")
LAYERS = 3


@pytest.fixture(scope="session")
def prefix_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("prefix-models")
    return {
        key: write_test_model(folder / f"{key}.gguf", architecture=key, block_count=LAYERS).path
        for key in ("llama", "qwen2")
    }


@pytest.fixture(scope="session")
def served_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four layers, so two stages take two each."""
    folder = tmp_path_factory.mktemp("prefix-serve")
    return write_test_model(folder / "qwen2.gguf", architecture="qwen2", block_count=4).path


SERVE_ARGS = ("--stages", "2", "--parallel", "2", "--context", "1024", "--prefix-cache-chunk", "16")


@pytest.fixture(scope="session")
def cache_on(served_model: Path) -> Iterator[Served]:
    with strata_serve(str(served_model), *SERVE_ARGS) as served:
        yield served


@pytest.fixture(scope="session")
def cache_off(served_model: Path) -> Iterator[Served]:
    with strata_serve(str(served_model), *SERVE_ARGS, "--prefix-cache-bytes", "0") as served:
        yield served
