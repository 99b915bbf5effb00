"""Shared fixtures. The control plane starts once per test session, only when a test asks for it."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from kubernetes import client, config
from strata_testbed.controlplane import ControlPlane
from strata_testbed.gpu_pool import create_gpu_pool
from strata_testbed.waiting import establish_crd

# As `strata` sets it (strata.cli says why): the tests start stage processes from a process with open channels.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

if not torch.cuda.is_available():
    # Without a GPU the Triton kernels' tests run them under Triton's interpreter. triton.jit chooses the interpreter
    # when a function is decorated, Triton's own library functions included, so the flag must be set before anything
    # imports triton (torch alone does not; the stage worker's modules do).
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def control_plane() -> Iterator[ControlPlane]:
    """etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok on loopback, with the GPU pool."""
    with ControlPlane() as plane:
        api_client = config.new_client_from_config(config_file=str(plane.kubeconfig))
        create_gpu_pool(client.CoreV1Api(api_client))
        api_client.close()
        yield plane


@pytest.fixture
def api_client(control_plane: ControlPlane) -> Iterator[client.ApiClient]:
    api = config.new_client_from_config(config_file=str(control_plane.kubeconfig))
    yield api
    api.close()


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane) -> Iterator[client.ApiClient]:
    """A client of the test bed with the ModelDeployment CRD established."""
    from strata.operator.crd import render_crd

    api = config.new_client_from_config(config_file=str(control_plane.kubeconfig))
    establish_crd(api, render_crd())
    yield api
    api.close()
