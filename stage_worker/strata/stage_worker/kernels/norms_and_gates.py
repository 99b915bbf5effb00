"""The residual add with its RMS norm, and a gated feed-forward's act(gate) * up: one function each, two bodies.

`add_rms_norm`, `rms_norm` and `activate` are what the model calls. In an eager step on a GPU (a prefill chunk) they
run Triton (strata.stage_worker.kernels.norms_and_gates_triton), one launch that reads each input once; inside
torch.compile (a decode step's block) and anywhere else they run the references of strata.stage_worker.kernels.
quant_matmul (`normed_reference`, `activated`), which inductor fuses with their neighbours and the kernels' tests take
as oracle.
"""

from __future__ import annotations

import torch
from strata.stage_worker.kernels import quant_matmul
from strata.stage_worker.kernels.quant_matmul import Gate, _device, activated, normed_reference
from torch import Tensor


def _eager_on_gpu(x: Tensor) -> bool:
    return x.is_cuda and not torch.compiler.is_compiling()


def kernel_add_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The Triton kernel on any device (on the CPU under Triton's interpreter: the tests' way in)."""
    from strata.stage_worker.kernels import norms_and_gates_triton

    with _device(x):
        return norms_and_gates_triton.add_rms_norm(x, residual, weight, eps)


def kernel_activated(gate_up: Tensor, gate: Gate) -> Tensor:
    """The Triton kernel on any device (on the CPU under Triton's interpreter: the tests' way in)."""
    from strata.stage_worker.kernels import norms_and_gates_triton

    with _device(gate_up):
        return norms_and_gates_triton.activated(gate_up, int(gate))


# A program of the norm kernel holds a whole row in registers: 16 warps keep 16,384 values (Llama 3.1 405B's width)
# at 32 a thread; a wider row takes the reference.
NORM_MAX_COLUMNS = 16384


def _rows_fit(x: Tensor, weight: Tensor) -> bool:
    return (
        x.dim() == 2
        and x.stride(-1) == 1
        and x.shape[-1] <= NORM_MAX_COLUMNS
        and weight.dtype == x.dtype
        and weight.is_contiguous()
    )


def add_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(h, rms_norm(h) * weight) with h = x + residual (x without one), both in x's dtype."""
    fits = _rows_fit(x, weight) and (residual is None or (residual.shape == x.shape and residual.stride(-1) == 1))
    if _eager_on_gpu(x) and fits:
        return kernel_add_rms_norm(x, residual, weight, eps)
    return normed_reference(x, residual, weight, eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The model's RMSNorm over x's last dimension (quant_matmul.rms_norm)."""
    rows = x.reshape(-1, x.shape[-1]) if x.is_contiguous() else x
    if _eager_on_gpu(x) and _rows_fit(rows, weight):
        return kernel_add_rms_norm(rows, None, weight, eps)[1].view(x.shape)
    return quant_matmul.rms_norm(x, weight, eps)


def activate(gate_up: Tensor, gate: Gate) -> Tensor:
    """act(gate) * up of gate_up [M, 2K] -> [M, K], in f32 and rounded once to gate_up's dtype."""
    if _eager_on_gpu(gate_up) and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
        return kernel_activated(gate_up, gate)
    return activated(gate_up, gate)
