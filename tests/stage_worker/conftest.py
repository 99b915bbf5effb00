"""Fixtures for the stage worker: the shared generated test models, three layers each so they split three ways."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from strata.gguf.testmodels import SMALL_SHAPES, write_test_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
LAYERS = 3


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("models")
    return {
        key: write_test_model(folder / f"{key}.gguf", architecture=key, block_count=LAYERS).path for key in SMALL_SHAPES
    }


@pytest.fixture(scope="module")
def device() -> torch.device:
    """Where the Triton kernels run: the GPU, or the CPU under Triton's interpreter (tests/conftest.py sets it)."""
    if torch.cuda.is_available():
        return torch.device("cuda:0")
    assert os.environ.get("TRITON_INTERPRET") == "1", (
        "tests/conftest.py sets Triton's interpreter on machines without a GPU"
    )
    return torch.device("cpu")
