"""Fixtures for the prefix cache: generated three-layer models, so a pipeline splits into 1, 2 or 3 stages."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from strata.gguf.testmodels import write_test_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
LAYERS = 3


@pytest.fixture(scope="session")
def prefix_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("prefix-models")
    return {
        key: write_test_model(folder / f"{key}.gguf", architecture=key, block_count=LAYERS).path
        for key in ("llama", "qwen2")
    }
