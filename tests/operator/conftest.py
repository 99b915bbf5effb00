"""Fixtures of the operator's tests on the test bed: the CRD installed once, a namespace per test, the models."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client, config
from strata.gguf.testmodels.shapes import LARGE_SHAPES
from strata.gguf.testmodels.writer import write_header_only_model
from strata.operator.crd import render_crd
from strata_testbed.controlplane import ControlPlane
from strata_testbed.waiting import establish_crd


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("models")
    big = dataclasses.replace(LARGE_SHAPES["llama3-70b"], name="Larger-than-the-pool", block_count=8000)
    return {
        "70b": write_header_only_model(folder / "llama3-70b.gguf", shape="llama3-70b").path,
        "too-big": write_header_only_model(folder / "too-big.gguf", shape=big).path,
    }


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane) -> Iterator[client.ApiClient]:
    api = config.new_client_from_config(config_file=str(control_plane.kubeconfig))
    establish_crd(api, render_crd())
    yield api
    api.close()


@pytest.fixture
def namespace(cluster: client.ApiClient) -> Iterator[str]:
    core = client.CoreV1Api(cluster)
    name = f"op-{uuid.uuid4().hex[:6]}"
    core.create_namespace(body={"metadata": {"name": name}})
    yield name
    core.delete_namespace(name=name)
