"""The dp4a candidate (quant_dot8_triton) on a table of named cases: the kernel against the function it computes
(x rounded to 8 bits a block of 32, then the exact product: only f32 accumulation between them), and that function
against the exact product within the bf16 tolerance of the matmul tests.

Without a GPU the kernel runs under Triton's interpreter (tests/conftest.py), its dp4a in plain integer arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
import triton
from gguf import GGMLQuantizationType
from strata.stage_worker.kernels import quant_dot8_triton
from strata.stage_worker.kernels.product_outputs_triton import split_output
from strata.stage_worker.kernels.quant_blocks_triton import LAYOUTS
from strata.stage_worker.kernels.quant_matmul import DOT8_MIN_WEIGHTS, DOT8_TYPES, product_path
from strata.stage_worker.weights.formats import dequantize, plane_names

from tests.stage_worker.test_quant_matmul import Case as MatmulCase
from tests.stage_worker.test_quant_matmul import random_planes, relative_error, tolerance

Q = GGMLQuantizationType


@dataclass(frozen=True)
class Case:
    name: str
    ggml_type: GGMLQuantizationType
    m: int
    n: int  # not a multiple of the kernel's 8 weight rows
    k: int  # ending inside a tile of chunks, and past one split where `splits` asks for more
    blocks: str = "normal"  # the f16 fields, as test_quant_matmul's cases make them
    outlier: bool = False  # one block of x 100 times the others: its small values round to few levels
    splits: int | None = None
    chunks: int | None = None  # chunks a program's step: few, so that K is steps enough to split


CASES = [
    Case("Q8_0 one row", Q.Q8_0, 1, 37, 96),
    Case("Q8_0 three rows", Q.Q8_0, 3, 21, 1088),
    Case("Q8_0 four rows, split along K", Q.Q8_0, 4, 19, 1088, splits=3, chunks=8),
    Case("Q8_0 four rows, extreme scales", Q.Q8_0, 4, 19, 96, "extreme"),
    Case("Q8_0 two rows, an outlier block of x", Q.Q8_0, 2, 19, 256, outlier=True),
    Case("Q4_K one row", Q.Q4_K, 1, 37, 768),
    Case("Q4_K four rows", Q.Q4_K, 4, 21, 1280),
    Case("Q4_K three rows, split along K", Q.Q4_K, 3, 19, 1280, splits=2, chunks=4),
    Case("Q4_K one row, split along K (the down projection's launch)", Q.Q4_K, 1, 37, 1280, splits=4, chunks=2),
    Case("Q4_K four rows, negative minimums", Q.Q4_K, 4, 19, 768, "negative"),
    Case("Q4_K two rows, zero blocks", Q.Q4_K, 2, 19, 768, "zero"),
    Case("Q4_K four rows, extreme scales", Q.Q4_K, 4, 19, 768, "extreme"),
    Case("Q6_K one row", Q.Q6_K, 1, 37, 768),
    Case("Q6_K four rows", Q.Q6_K, 4, 21, 1280),
    Case("Q6_K three rows, split along K", Q.Q6_K, 3, 19, 1280, splits=2, chunks=4),
    Case("Q6_K four rows, extreme scales", Q.Q6_K, 4, 19, 768, "extreme"),
    Case("Q6_K two rows, zero blocks", Q.Q6_K, 2, 19, 768, "zero"),
]


@pytest.mark.parametrize("case", [c for c in CASES if c.splits], ids=lambda c: c.name)
def test_split_cases_split(case: Case) -> None:
    """The cases that ask for splits get them: K is steps enough at their chunks, so the parts are summed in the
    kernel (product_outputs_triton.sum_splits)."""
    block_n, chunks, _ = quant_dot8_triton.launch_shape(case.ggml_type, case.m, block_n=None, chunks=case.chunks,
                                                        num_warps=None)  # fmt: skip
    n_chunks = case.k // LAYOUTS[case.ggml_type].values_per_chunk
    _, out = split_output(torch.zeros(case.m, case.k), n=case.n, n_chunks=n_chunks,
                          chunks=min(chunks, triton.next_power_of_2(n_chunks)), programs=-(-case.n // block_n),
                          splits=case.splits)  # fmt: skip
    assert out.splits == case.splits


def _inputs(case: Case) -> tuple[torch.Tensor, list[torch.Tensor]]:
    rng = np.random.default_rng(len(case.name) * 7 + case.m)
    planes = random_planes(MatmulCase("", case.ggml_type, case.m, case.n, case.k, case.blocks), rng)
    w = dequantize(planes, case.ggml_type)
    scale = min(1.0, 100.0 / float(w.abs().sum(dim=1).max().clamp_min(1e-30)))
    x = torch.from_numpy(rng.standard_normal((case.m, case.k))).float() * scale
    if case.outlier:
        x[0, 32:64] *= 100.0
    return x, list(planes.values())


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_kernel_computes_its_function(case: Case, device: torch.device) -> None:
    x, planes = _inputs(case)
    on_device = [p.to(device) for p in planes]
    ours = quant_dot8_triton.dot8(x.to(device), on_device, case.ggml_type, splits=case.splits, chunks=case.chunks).cpu()
    expected = quant_dot8_triton.reference(x.to(device), on_device, case.ggml_type)
    q, d, _ = quant_dot8_triton.quantise_rows(x.to(device))
    bound = quant_dot8_triton.dequantised_rows(q, d).cpu().abs() @ _weight(case, planes).abs().T
    error = float(((ours - expected).abs() / (bound + torch.finfo(torch.float32).tiny)).max())
    assert error <= tolerance(torch.float32), f"{case.name}: {error:.2e} from the function it computes"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_x_rounds_to_the_nearest_of_255_levels_a_block(case: Case, device: torch.device) -> None:
    x, _ = _inputs(case)
    q, d, s = (t.cpu() for t in quant_dot8_triton.quantise_rows(x.to(device)))
    rounded = quant_dot8_triton.dequantised_rows(q, d)
    blocks = x.view(case.m, -1, 32)
    assert torch.allclose(d, blocks.abs().amax(dim=2) / 127.0, rtol=1e-6, atol=0.0)
    step = d.repeat_interleave(32, dim=1)
    assert bool(((rounded - x).abs() <= step * (0.5 + 1e-5)).all()), "each value within half a step"
    # s = d sum(q) rounds once; the sum of the 32 rounded values 32 times, each within 127 d 2^-24.
    assert bool(((s - rounded.view(case.m, -1, 32).sum(dim=2)).abs() <= 32 * 127 * 2**-23 * d).all())


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_its_function_is_the_product_within_bf16s_tolerance(case: Case, device: torch.device) -> None:
    x, planes = _inputs(case)
    function = quant_dot8_triton.reference(x.to(device), [p.to(device) for p in planes], case.ggml_type)
    error = relative_error(function, x, _weight(case, planes))
    assert error <= tolerance(torch.bfloat16), f"{case.name}: {error:.2e}"
    assert error > tolerance(torch.float32), "x's rounding to 8 bits shows: the check above is not vacuous"


def _weight(case: Case, planes: list[torch.Tensor]) -> torch.Tensor:
    return dequantize(dict(zip(plane_names(case.ggml_type), planes, strict=True)), case.ggml_type)


def test_refuses_what_it_does_not_take() -> None:
    x = torch.zeros(5, 64)
    with pytest.raises(ValueError, match="up to 4 rows"):
        quant_dot8_triton.dot8(
            x, [torch.zeros(1, 2, dtype=torch.float16), torch.zeros(1, 64, dtype=torch.int8)], Q.Q8_0
        )
    with pytest.raises(ValueError, match="not Q5_K"):
        quant_dot8_triton.dot8(x[:1], [], Q.Q5_K)


def test_the_product_path_takes_every_type_it_offers() -> None:
    assert set(quant_dot8_triton.FAMILIES) == DOT8_TYPES


BIG = DOT8_MIN_WEIGHTS  # Llama-3-8B's gate_up has 3.5 times this, its qkv 0.75 times
PATHS = [
    # name, rows, weights, type, dtype, on a GPU, gated, path
    ("two rows of a big Q4_K matrix", 2, BIG, Q.Q4_K, torch.bfloat16, True, False, "dot8"),
    ("four rows of a big Q6_K matrix", 4, 4 * BIG, Q.Q6_K, torch.bfloat16, True, False, "dot8"),
    ("three rows of a big Q8_0 matrix", 3, BIG, Q.Q8_0, torch.bfloat16, True, False, "dot8"),
    ("one row of Q8_0: the fused kernel", 1, 16 * BIG, Q.Q8_0, torch.bfloat16, True, False, "fused"),
    ("one row of a big Q4_K matrix (gate_up)", 1, BIG, Q.Q4_K, torch.bfloat16, True, False, "dot8"),
    ("one row of Q6_K's output head", 1, 16 * BIG, Q.Q6_K, torch.bfloat16, True, False, "dot8"),
    ("one row of Q6_K's down (under its one-row bound)", 1, 2 * BIG - 1, Q.Q6_K, torch.bfloat16, True, False, "fused"),
    ("one row of a small Q4_K matrix", 1, BIG - 1, Q.Q4_K, torch.bfloat16, True, False, "fused"),
    ("five rows: the tensor-core kernel", 5, 4 * BIG, Q.Q8_0, torch.bfloat16, True, False, "gemm"),
    ("a matrix under the bound (qkv)", 4, BIG - 1, Q.Q4_K, torch.bfloat16, True, False, "fused"),
    ("a type dp4a does not take", 4, BIG, Q.Q5_K, torch.bfloat16, True, False, "fused"),
    ("f16 x keeps its precision", 4, BIG, Q.Q4_K, torch.float16, True, False, "fused"),
    ("f32 x keeps its precision", 4, BIG, Q.Q4_K, torch.float32, True, False, "fused"),
    ("the CPU keeps the fused kernel's function", 4, BIG, Q.Q4_K, torch.bfloat16, False, False, "fused"),
    ("a gated x (formed on load)", 4, BIG, Q.Q4_K, torch.bfloat16, True, True, "fused"),
    ("past the tensor-core kernel's rows", 65, BIG, Q.Q4_K, torch.bfloat16, True, False, "dense"),
    ("a type with no fused kernel", 2, BIG, Q.Q2_K, torch.bfloat16, True, False, "dense"),
]


@pytest.mark.parametrize(("name", "rows", "weights", "ggml_type", "dtype", "cuda", "gated", "path"), PATHS,
                         ids=[p[0] for p in PATHS])  # fmt: skip
def test_product_path(
    name: str, rows: int, weights: int, ggml_type: GGMLQuantizationType, dtype: torch.dtype, cuda: bool, gated: bool,
    path: str,
) -> None:  # fmt: skip
    assert product_path(rows, weights, ggml_type, dtype=dtype, cuda=cuda, gated=gated) == path, name
