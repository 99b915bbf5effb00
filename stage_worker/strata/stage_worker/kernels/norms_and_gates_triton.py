"""An eager step's row-wise work in Triton, one launch each: the residual add with the RMS norm after it, and a gated
feed-forward's act(gate) * up.

Why kernels of our own: a prefill step runs its blocks eagerly, and torch spent 48 of the 153 ms of a 4,096-token
first token (H100, Llama-3-8B shape, 2026-12-07, bench/decode_profile.py --prefill) in elementwise kernels, most of
them the norms' f32 round trips (x.float(), the norm, the rounding copy, the weight's product: five passes over the
rows, two of them at twice the bytes) and the activation of a 235 MB gate/up output taken to f32 and back. Here each
reads its inputs once and writes its outputs once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from strata.stage_worker.kernels.quant_blocks_triton import act_times_up
from torch import Tensor

ACTIVATED_BLOCK = 1024  # gate values a program: a row of a Llama-3-8B step's 14,336 in 14 programs


@triton.jit
def _add_rms_norm(x_ptr, residual_ptr, weight_ptr, h_ptr, out_ptr, columns, stride_x, stride_r, stride_h, stride_o,
                  eps, ADD: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """One row a program: h = x (+ residual) rounded to x's dtype (stored where ADD), then weight * (h / rms(h)),
    the normalised row rounded to x's dtype before the weight's product as the model's rms_norm rounds it."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < columns
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    h = x
    if ADD:
        residual = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        h = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(h_ptr + row * stride_h + offs, h, mask=mask)
    values = h.to(tl.float32)
    inverse_rms = tl.rsqrt(tl.sum(values * values, axis=0) / columns + eps)
    normed = (values * inverse_rms).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * weight).to(x.dtype), mask=mask)


def add_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """x [M, D] (+ residual [M, D]), weight [D] of x's dtype -> (h, weight * rms_norm(h)), both [M, D] in x's dtype;
    h is x itself without a residual."""
    rows, columns = x.shape
    if x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("add_rms_norm reads rows whose columns are dense")
    h = x if residual is None else torch.empty_like(x)
    out = torch.empty_like(x)
    if rows == 0:
        return h, out
    block = triton.next_power_of_2(columns)
    _add_rms_norm[(rows,)](
        x, x if residual is None else residual, weight, h, out, columns, x.stride(0),
        0 if residual is None else residual.stride(0), h.stride(0), out.stride(0), eps,
        ADD=residual is not None, BLOCK=block, num_warps=max(1, min(16, block // 512)),
    )  # fmt: skip
    return h, out


@triton.jit
def _activated(gate_up_ptr, out_ptr, half, stride_in, stride_out, GATE: tl.constexpr, BLOCK: tl.constexpr):
    """act(gate) * up of a block of one row's gate values and the up values `half` columns on, in f32, rounded once."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < half
    gate = tl.load(gate_up_ptr + row * stride_in + offs, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + half + offs, mask=mask, other=0.0)
    out = act_times_up(gate.to(tl.float32), up.to(tl.float32), GATE)
    tl.store(out_ptr + row * stride_out + offs, out.to(gate.dtype), mask=mask)


def activated(gate_up: Tensor, gate: int) -> Tensor:
    """gate_up [M, 2K] -> act(gate) * up [M, K] in gate_up's dtype; `gate` a quant_matmul.Gate other than NONE."""
    rows, width = gate_up.shape
    if gate_up.stride(1) != 1 or width % 2:
        raise ValueError(f"activated takes rows of gate then up, dense columns of an even count, not {width}")
    half = width // 2
    out = gate_up.new_empty((rows, half))
    if rows == 0 or half == 0:
        return out
    _activated[(rows, triton.cdiv(half, ACTIVATED_BLOCK))](
        gate_up, out, half, gate_up.stride(0), out.stride(0), GATE=gate, BLOCK=ACTIVATED_BLOCK, num_warps=4
    )
    return out
