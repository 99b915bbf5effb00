"""An eager step's add + RMS norm and act(gate) * up in one launch each (strata.stage_worker.kernels.norms_and_gates):
the Triton kernels against the references the model runs elsewhere (quant_matmul.normed_reference and .activated), on
the CPU under Triton's interpreter and on a GPU compiled: rows of widths that are and are not a power of two, values
far past a half's range squared, rows of zeros; and what the kernels refuse."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from strata.stage_worker.kernels import norms_and_gates
from strata.stage_worker.kernels.quant_matmul import Gate, activated, normed_reference

from tests.stage_worker.test_quant_matmul import dtypes

EPS = 1e-6


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """One rounding of the output apart: the sum of squares in another order may move 1/rms by an f32 ulp, and
    GELU's tail, 0.5 g (1 + tanh) in torch against g * sigmoid in the kernel, cancels differently near zero."""
    rtol = {torch.float32: 1e-5, torch.float16: 1e-3}.get(dtype, 8e-3)
    torch.testing.assert_close(got, want, rtol=rtol, atol=1e-5)


@dataclass(frozen=True)
class NormCase:
    name: str
    rows: int
    columns: int
    residual: bool = True
    scale: float = 1.0  # of x and the residual
    zero_rows: tuple[int, ...] = ()


NORM_CASES = [
    NormCase("one row with a residual", 1, 256),
    NormCase("rows of a width not a power of two", 5, 96),
    NormCase("no residual", 3, 128, residual=False),
    NormCase("a Llama-3-8B row", 2, 4096),
    NormCase("values whose squares pass a half's range", 3, 64, scale=300.0),
    NormCase("tiny values", 3, 64, scale=1e-3),
    NormCase("a row of zeros", 4, 64, zero_rows=(1,)),
]


@pytest.mark.parametrize(
    ("case", "dtype"),
    [pytest.param(c, d, id=f"{c.name}-{str(d).removeprefix('torch.')}") for c in NORM_CASES for d in dtypes()],
)
def test_add_rms_norm_matches_the_model_norm(case: NormCase, dtype: torch.dtype, device: torch.device) -> None:
    g = torch.Generator().manual_seed(case.rows * 31 + case.columns)
    x = (torch.randn(case.rows, case.columns, generator=g) * case.scale).to(dtype)
    residual = (torch.randn(case.rows, case.columns, generator=g) * case.scale).to(dtype) if case.residual else None
    for row in case.zero_rows:
        x[row] = 0
        if residual is not None:
            residual[row] = 0
    weight = (1 + torch.randn(case.columns, generator=g) / 4).to(dtype)
    want_h, want = normed_reference(x, residual, weight, EPS)
    h, out = norms_and_gates.kernel_add_rms_norm(
        x.to(device), None if residual is None else residual.to(device), weight.to(device), EPS
    )
    assert torch.equal(h.cpu(), want_h), "h is x + residual rounded once, as torch adds"
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    assert_close(out.cpu(), want, dtype)
    for row in case.zero_rows:
        assert not out[row].any(), f"row {row} of zeros normed to {out[row]}"


@dataclass(frozen=True)
class GateCase:
    name: str
    rows: int
    half: int  # gate columns, and up columns
    gate: Gate = Gate.SILU
    scale: float = 1.0  # of the gates


GATE_CASES = [
    GateCase("one row, SiLU", 1, 19),
    GateCase("rows across two programs, SiLU", 3, 1500),
    GateCase("GELU (tanh)", 4, 77, Gate.GELU_TANH),
    GateCase("gates far past exp's range, SiLU", 2, 64, scale=200.0),
    GateCase("gates far past exp's range, GELU (tanh)", 2, 64, Gate.GELU_TANH, scale=200.0),
]


@pytest.mark.parametrize(
    ("case", "dtype"),
    [pytest.param(c, d, id=f"{c.name}-{str(d).removeprefix('torch.')}") for c in GATE_CASES for d in dtypes()],
)
def test_activated_rows_match_the_reference(case: GateCase, dtype: torch.dtype, device: torch.device) -> None:
    g = torch.Generator().manual_seed(case.rows * 7 + case.half)
    gate_up = torch.randn(case.rows, 2 * case.half, generator=g)
    gate_up[:, : case.half] *= case.scale
    gate_up = gate_up.to(dtype)
    gate_up[0, :3] = 0
    out = norms_and_gates.kernel_activated(gate_up.to(device), case.gate)
    assert out.shape == (case.rows, case.half)
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    assert_close(out.cpu(), activated(gate_up, case.gate), dtype)


def test_swapped_halves_differ(device: torch.device) -> None:
    """The kernel takes the gate from the first half: the same rows with the halves swapped give other values."""
    gate_up = torch.randn(2, 64, generator=torch.Generator().manual_seed(3))
    swapped = torch.cat([gate_up[:, 32:], gate_up[:, :32]], dim=1)
    out = norms_and_gates.kernel_activated(gate_up.to(device), Gate.SILU).cpu()
    assert not torch.allclose(out, activated(swapped, Gate.SILU), atol=1e-3)


def test_norm_rows_must_be_dense(device: torch.device) -> None:
    x = torch.randn(8, 4, device=device).t()
    with pytest.raises(ValueError, match="columns are dense"):
        norms_and_gates.kernel_add_rms_norm(x, None, torch.ones(8, device=device), EPS)


def test_an_odd_gate_up_width_is_refused(device: torch.device) -> None:
    gate_up = torch.randn(2, 7, device=device)
    with pytest.raises(ValueError, match="even count, not 7"):
        norms_and_gates.kernel_activated(gate_up, Gate.SILU)


def test_the_dispatch_runs_the_references_off_a_gpu() -> None:
    """On the CPU the model's norms and activation are the references themselves, bit for bit; a strided 3-D x (a
    q/k norm over heads) takes the reference on any device."""
    g = torch.Generator().manual_seed(5)
    x, residual, weight = torch.randn(3, 32, generator=g), torch.randn(3, 32, generator=g), torch.rand(32, generator=g)
    for got, want in zip(norms_and_gates.add_rms_norm(x, residual, weight, EPS),
                         normed_reference(x, residual, weight, EPS), strict=True):  # fmt: skip
        assert torch.equal(got, want)
    heads = torch.randn(3, 2, 48, generator=g)[..., :16]
    want = normed_reference(heads, None, weight[:16], EPS)[1]
    assert torch.equal(norms_and_gates.rms_norm(heads, weight[:16], EPS), want)
    assert torch.equal(norms_and_gates.activate(x, Gate.SILU), activated(x, Gate.SILU))
