"""A step's new K and V rows quantised into a q8_0 pool in one Triton launch: ggml's block_q8_0 per 32 values (the
f16 scale max|x| / 127, the values round(x / scale)), computed exactly as strata.stage_worker.kernels.kv_write's
reference computes them.

Why a kernel: compiled from torch, the write of one layer's K and V was six kernels (two maxima, four scattered
stores), each a few microseconds for a few kilobytes: 0.27 ms of a 4.5 ms decode step of a 32-layer model on an H100.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

# Adding and subtracting 1.5 * 2^23 rounds an f32 of magnitude below 2^22 to the nearest integer, ties to even (the
# rounding of torch.round), with no rounding function the interpreter lacks.
ROUND: tl.constexpr = tl.constexpr(12582912.0)


@triton.jit
def _quantise_row(src_ptr, row, stride_src, dst_ptr, scales_ptr, cell, stride_dst, stride_sc, n_blocks,
                  BLOCKS: tl.constexpr):  # fmt: skip
    b = tl.arange(0, BLOCKS)
    e = tl.arange(0, 32)
    ok = b < n_blocks
    columns = b[:, None] * 32 + e[None, :]
    x = tl.load(src_ptr + row * stride_src + columns, mask=ok[:, None], other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.max(tl.abs(x), axis=1), 127.0)  # IEEE division, as torch divides
    inverse = tl.where(scale > 0, tl.math.div_rn(1.0, scale), 0.0)
    q = (x * inverse[:, None] + ROUND) - ROUND
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    tl.store(dst_ptr + cell * stride_dst + columns, q.to(tl.int8), mask=ok[:, None])
    tl.store(scales_ptr + cell * stride_sc + b, scale.to(tl.float16), mask=ok)


@triton.jit
def _write_q8(k_ptr, v_ptr, cells_ptr, kv_ptr, ks_ptr, vv_ptr, vs_ptr,
              stride_k, stride_v, stride_kv, stride_ks, stride_vv, stride_vs, k_blocks, v_blocks,
              K_BLOCKS: tl.constexpr, V_BLOCKS: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    cell = tl.load(cells_ptr + row).to(tl.int64)
    if tl.program_id(1) == 0:
        _quantise_row(k_ptr, row, stride_k, kv_ptr, ks_ptr, cell, stride_kv, stride_ks, k_blocks, K_BLOCKS)
    else:
        _quantise_row(v_ptr, row, stride_v, vv_ptr, vs_ptr, cell, stride_vv, stride_vs, v_blocks, V_BLOCKS)


def write_q8(
    *, k: Tensor, v: Tensor, cells: Tensor, k_values: Tensor, k_scales: Tensor, v_values: Tensor, v_scales: Tensor
) -> None:
    """Row i of k and v into cell cells[i] of the stores (values [cells, width] int8, scales [cells, width / 32]
    f16); k and v [N, width] with dense rows, in any float dtype."""
    n = k.shape[0]
    if n == 0:
        return
    k_blocks, v_blocks = k_scales.shape[1], v_scales.shape[1]
    _write_q8[(n, 2)](
        k, v, cells, k_values, k_scales, v_values, v_scales,
        k.stride(0), v.stride(0), k_values.stride(0), k_scales.stride(0), v_values.stride(0), v_scales.stride(0),
        k_blocks, v_blocks, K_BLOCKS=triton.next_power_of_2(k_blocks), V_BLOCKS=triton.next_power_of_2(v_blocks),
    )  # fmt: skip
