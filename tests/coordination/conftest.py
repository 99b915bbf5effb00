"""A real pipeline of two stage servers on loopback, shared by the fencing and takeover tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from strata.gguf.testmodels import write_test_model
from strata.stage_worker.server import RunningStage
from strata_testbed.pipelines import local_pipeline

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four layers, two stages of two."""
    return write_test_model(
        tmp_path_factory.mktemp("coordination") / "qwen2.gguf", architecture="qwen2", block_count=4
    ).path


@pytest.fixture
def stages(model: Path) -> Iterator[list[RunningStage]]:
    """Fresh stages per test: each starts with no accepted term."""
    with local_pipeline(model, [(0, 2), (2, 4)], context=512, parallel=2) as running:
        yield running
