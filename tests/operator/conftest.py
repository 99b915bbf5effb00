"""Fixtures of the operator's tests on the test bed: a namespace per test, the models, the operator running as a
process (tests/conftest.py installs the CRD)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client
from strata.gguf.testmodels.shapes import LARGE_SHAPES
from strata.gguf.testmodels.writer import write_header_only_model
from strata_testbed.controlplane import ControlPlane
from strata_testbed.operator_run import OperatorProcess
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


@pytest.fixture
def operator(control_plane: ControlPlane, namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    process = OperatorProcess(control_plane.kubeconfig, namespace, tmp_path / "operator.log")
    process.start()
    yield process
    process.stop()
    print((tmp_path / "operator.log").read_text(errors="replace")[-6000:])  # shown when the test fails
