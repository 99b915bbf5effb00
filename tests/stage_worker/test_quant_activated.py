"""A decode step's feed-forward in one launch: act(gate) * up formed as the gate/up product's programs store
(`activate`), each program taking gate rows and the matching up rows; with the residual add and norm in its load of
x too (quant_matmul.kernel_normed), in the fused kernel and in the dp4a one (quant_dot8_triton, x rounded to 8 bits).
Checked against the model's own order: the norm, the product rounded to x's dtype, then quant_matmul.activated; on
the CPU under Triton's interpreter, on a GPU compiled."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from strata.stage_worker.kernels import quant_dot8_triton, quant_matmul
from strata.stage_worker.kernels.quant_matmul import Gate, activated, kernel, kernel_normed, normed_reference
from strata.stage_worker.weights.formats import dequantize

from tests.stage_worker.test_quant_matmul import Case as MatmulCase
from tests.stage_worker.test_quant_matmul import dtypes, random_planes, tolerance

Q = GGMLQuantizationType
EPS = 1e-6


@dataclass(frozen=True)
class Case:
    name: str
    ggml_type: GGMLQuantizationType
    m: int  # 1-4: the fused kernel; 6: torch forms the norm, the tensor-core product, then the activation
    ffn: int  # gate rows (and up rows): not a multiple of a program's pairs
    gate: Gate = Gate.SILU
    residual: bool = True


CASES = [
    Case("Q8_0 one row, SiLU", Q.Q8_0, 1, 19),
    Case("Q8_0 one row, GELU (tanh)", Q.Q8_0, 1, 19, Gate.GELU_TANH),
    Case("Q8_0 three rows", Q.Q8_0, 3, 21),
    Case("Q8_0 one row, no residual", Q.Q8_0, 1, 19, residual=False),
    Case("Q4_K one row", Q.Q4_K, 1, 19),
    Case("Q6_K four rows, GELU (tanh)", Q.Q6_K, 4, 13, Gate.GELU_TANH),
    Case("Q8_0 six rows through torch", Q.Q8_0, 6, 19),
]


def expected(case: Case, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
             w: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The model's order apart: h, its norm, the gate/up product rounded to x's dtype, the activation."""
    _, normed = normed_reference(x, residual, weight, EPS)
    return activated((normed.float() @ w.T).to(x.dtype), case.gate)


@pytest.mark.parametrize(
    ("case", "dtype"),
    [pytest.param(c, d, id=f"{c.name}-{str(d).removeprefix('torch.')}") for c in CASES for d in dtypes()],
)
def test_activated_product_matches_the_model_order(case: Case, dtype: torch.dtype, device: torch.device) -> None:
    k = 256 if case.ggml_type in (Q.Q4_K, Q.Q6_K) else 96
    rng = np.random.default_rng(case.m * 17 + case.ffn)
    planes = random_planes(MatmulCase("", case.ggml_type, case.m, 2 * case.ffn, k, "normal"), rng)
    w = dequantize(planes, case.ggml_type)
    x = torch.from_numpy(rng.standard_normal((case.m, k))).float().to(dtype)
    residual = torch.from_numpy(rng.standard_normal((case.m, k))).float().to(dtype) if case.residual else None
    # Gate and up within 10 of zero whatever the weights' magnitude, so that act(gate) * up stays inside f16's range.
    scale = min(1.0, 10.0 / float(w.abs().sum(dim=1).max().clamp_min(1e-30)))
    weight = ((1.0 + 0.1 * torch.from_numpy(rng.standard_normal(k)).float()) * scale).to(dtype)
    out, h = kernel_normed(
        x.to(device), None if residual is None else residual.to(device), [p.to(device) for p in planes.values()],
        case.ggml_type, columns=k, weight=weight.to(device), eps=EPS, activate=case.gate,
    )  # fmt: skip
    assert out.shape == (case.m, case.ffn)
    assert out.dtype == dtype
    assert torch.equal(h.cpu(), x if residual is None else x + residual)
    want = expected(case, x, residual, weight, w).float()
    # The product's accumulation order differs from the reference's, and a rounding of gate or up to x's dtype may
    # land a step apart: the worst difference as a share of the largest output.
    error = float((out.cpu().float() - want).abs().max() / want.abs().max())
    assert error <= 2 * tolerance(dtype), f"{case.name}: error {error:.2e} of the largest output"


@dataclass(frozen=True)
class PlainCase:
    name: str
    ggml_type: GGMLQuantizationType
    m: int
    ffn: int
    path: str  # "fused" (quant_matmul.kernel: the fused kernel up to 4 rows, then tensor cores) or "dot8"
    gate: Gate = Gate.SILU


PLAIN_CASES = [
    PlainCase("fused Q8_0 one row", Q.Q8_0, 1, 19, "fused"),
    PlainCase("fused Q4_K two rows, GELU (tanh)", Q.Q4_K, 2, 21, "fused", Gate.GELU_TANH),
    PlainCase("tensor cores Q8_0 six rows, then torch", Q.Q8_0, 6, 19, "fused"),
    PlainCase("dp4a Q4_K one row (the Q4_K_M gate/up)", Q.Q4_K, 1, 37, "dot8"),
    PlainCase("dp4a Q6_K three rows", Q.Q6_K, 3, 21, "dot8"),
    PlainCase("dp4a Q8_0 one row, GELU (tanh)", Q.Q8_0, 1, 19, "dot8", Gate.GELU_TANH),
]


@pytest.mark.parametrize("case", PLAIN_CASES, ids=lambda c: c.name)
def test_activated_plain_product_matches_the_product_then_activation(case: PlainCase, device: torch.device) -> None:
    k = 768 if case.ggml_type in (Q.Q4_K, Q.Q6_K) else 96
    rng = np.random.default_rng(case.m * 13 + case.ffn)
    planes = random_planes(MatmulCase("", case.ggml_type, case.m, 2 * case.ffn, k, "normal"), rng)
    w = dequantize(planes, case.ggml_type)
    scale = min(1.0, 10.0 / float(w.abs().sum(dim=1).max().clamp_min(1e-30)))
    x = torch.from_numpy(rng.standard_normal((case.m, k))).float() * scale
    on_device = [p.to(device) for p in planes.values()]
    if case.path == "dot8":
        out = quant_dot8_triton.dot8(x.to(device), on_device, case.ggml_type, activate=case.gate).cpu()
        product = quant_dot8_triton.reference(x.to(device), on_device, case.ggml_type)
    else:
        out = kernel(x.to(device), on_device, case.ggml_type, columns=k, activate=case.gate).cpu()
        product = x @ w.T
    assert out.shape == (case.m, case.ffn)
    want = activated(product.to(x.dtype), case.gate)
    error = float((out - want).abs().max() / want.abs().max())
    assert error <= 2 * tolerance(torch.float32), f"{case.name}: error {error:.2e} of the largest output"


def test_gate_and_up_swapped_fail_the_check(device: torch.device) -> None:
    """The check can fail: act(up) * gate (the halves the other way round) is far from act(gate) * up."""
    case = Case("", Q.Q8_0, 1, 19)
    rng = np.random.default_rng(3)
    planes = random_planes(MatmulCase("", Q.Q8_0, 1, 38, 96, "normal"), rng)
    w = dequantize(planes, Q.Q8_0)
    x, weight = torch.randn(1, 96), torch.ones(96)
    swapped = [p.reshape(2, 19, -1).flip(0).reshape(38, -1).contiguous().to(device) for p in planes.values()]
    out, _ = kernel_normed(x.to(device), None, swapped, Q.Q8_0, columns=96, weight=weight.to(device), eps=EPS,
                           activate=Gate.SILU)  # fmt: skip
    want = expected(case, x, None, weight, w)
    assert float((out.cpu() - want).abs().max() / want.abs().max()) > 0.1


def test_an_odd_matrix_is_refused(device: torch.device) -> None:
    planes = random_planes(MatmulCase("", Q.Q8_0, 1, 37, 96, "normal"), np.random.default_rng(4))
    with pytest.raises(ValueError, match=r"gate over up takes an even number of rows \(37\)"):
        kernel_normed(torch.randn(1, 96).to(device), None, [p.to(device) for p in planes.values()], Q.Q8_0,
                      columns=96, weight=torch.ones(96).to(device), eps=EPS, activate=Gate.SILU)  # fmt: skip


@pytest.mark.parametrize("m", [1, 6])
def test_the_activated_ops_pass_opcheck(m: int, device: torch.device) -> None:
    """The ops' schemas and fake implementations hold (what torch.compile relies on): [M, N / 2] out."""
    planes = [p.to(device) for p in random_planes(MatmulCase("", Q.Q8_0, m, 6, 64, "normal"),
                                                  np.random.default_rng(5)).values()]  # fmt: skip
    x, residual, weight = torch.randn(m, 64).to(device), torch.randn(m, 64).to(device), torch.randn(64).to(device)
    args = (x, residual, weight, EPS, planes, int(Q.Q8_0), 64, int(Gate.SILU))
    torch.library.opcheck(quant_matmul._quant_linear_normed_op, args)
    torch.library.opcheck(quant_matmul._quant_linear_op, (x, planes, int(Q.Q8_0), 64, int(Gate.NONE), int(Gate.SILU)))
