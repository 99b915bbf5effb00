"""Fixtures for the stage worker: tiny GGUF models of each architecture, written once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from strata_testbed.tiny_models import ARCHITECTURES, write_tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("models")
    return {key: write_tiny_model(folder / f"{key}.gguf", shape) for key, shape in ARCHITECTURES.items()}
