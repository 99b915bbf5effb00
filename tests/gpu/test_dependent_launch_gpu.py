"""Dependent launches on a GPU (strata.stage_worker.kernels.dependent_launch): each kernel of a chain starts before
the one ahead has finished and must still read that one's result, not what the buffer held before.

A CUDA graph of 48 normed products of one row, each reading the last one's output (the Q8_0 kernel of a decode
step), replayed with the input changed between replays: the results must equal, bit for bit, the same graph
captured with plain launches. A kernel that read its input before the wait would see the previous replay's values
somewhere in 48 links. The decode steps of test_decode_step_gpu.py run every
other kernel launched this way against their references.

These need a CUDA device; CI has none, so they run on a GPU lease and are skipped elsewhere.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from strata.gguf.testmodels.blocks import random_blocks
from strata.stage_worker.kernels import dependent_launch, quant_matmul_triton
from strata.stage_worker.weights.formats import plane_names, split_planes
from torch import Tensor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU lease)")

GPU = torch.device("cuda:0")
K = 4096
LINKS = 48


def chain(x: Tensor, weights: list[list[Tensor]], norm: Tensor) -> Tensor:
    for planes in weights:
        x, _ = quant_matmul_triton.quant_matmul_normed(
            x, planes, GGMLQuantizationType.Q8_0, columns=K, norm=quant_matmul_triton.Norm(weight=norm, eps=1e-6)
        )
    return x


def replays(setting: str, monkeypatch: pytest.MonkeyPatch, inputs: list[Tensor], weights: list[list[Tensor]],
            norm: Tensor) -> list[Tensor]:  # fmt: skip
    monkeypatch.setenv(dependent_launch.ENVIRONMENT, setting)
    static = inputs[0].clone()
    with dependent_launch.captured_step():
        chain(static, weights, norm)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), dependent_launch.captured_step():
        out = chain(static, weights, norm)
    results = []
    for x in inputs:
        static.copy_(x)
        graph.replay()
        results.append(out.clone())
    torch.cuda.synchronize()
    return results


def test_a_chain_of_dependent_products_reads_each_result(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dependent_launch.ENVIRONMENT, "1")
    with dependent_launch.captured_step():
        assert dependent_launch.enabled(GPU) == (torch.cuda.get_device_capability(GPU)[0] >= 9)
    rng = np.random.default_rng(7)
    weights = []
    for _ in range(LINKS):
        blocks = random_blocks(GGMLQuantizationType.Q8_0, rows=K, columns=K, rng=rng, std=K**-0.5)
        planes = split_planes(torch.from_numpy(blocks).reshape(-1), GGMLQuantizationType.Q8_0, rows=K)
        weights.append([planes[name].to(GPU) for name in plane_names(GGMLQuantizationType.Q8_0)])
    norm = torch.ones(K, dtype=torch.bfloat16, device=GPU)
    inputs = [torch.randn(1, K, dtype=torch.bfloat16, device=GPU) for _ in range(4)]
    plain = replays("0", monkeypatch, inputs, weights, norm)
    dependent = replays("1", monkeypatch, inputs, weights, norm)
    eager = chain(inputs[-1], weights, norm)
    for i, (a, b) in enumerate(zip(plain, dependent, strict=True)):
        assert torch.isfinite(a).all(), f"replay {i}: the plain chain is not finite"
        assert torch.equal(a, b), f"replay {i}: dependent launches differ from plain ones by {(a - b).abs().max()}"
    assert torch.equal(dependent[-1], eager)
    assert not torch.equal(dependent[0], dependent[1]), "the inputs changed between replays, so must the results"
