"""A step's new K and V rows into the pool in one Triton launch: quantised to ggml's block_q8_0 per 32 values (the
f16 scale max|x| / 127, the values round(x / scale)) as strata.stage_worker.kv_stores.quantise_q8 computes them, or
stored in the pool's plain type. `rope_write` also rotates q and k by RoPE on the way.

Why a kernel: compiled from torch, the write of one layer's K and V was six kernels (two maxima, four scattered
stores), each a few microseconds for a few kilobytes: 0.27 ms of a 4.5 ms decode step of a 32-layer model on an H100.
RoPE then stayed two kernels a layer (q and k), because torch.compile cannot fuse elementwise work into a custom
operator: with the rotation here, a layer's q, k and v leave the qkv projection through one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from strata.stage_worker.kernels import dependent_launch
from strata.stage_worker.kernels.dependent_launch import wait_for_inputs
from torch import Tensor

# Adding and subtracting 1.5 * 2^23 rounds an f32 of magnitude below 2^22 to the nearest integer, ties to even (the
# rounding of torch.round), with no rounding function the interpreter lacks.
ROUND: tl.constexpr = tl.constexpr(12582912.0)


@triton.jit
def _store_q8(x, ok, columns, dst_ptr, scales_ptr, cell, stride_dst, stride_sc, BLOCKS: tl.constexpr):
    """x [BLOCKS, 32] f32, one row's blocks (ok: [BLOCKS] inside the row), as block_q8_0 into `cell`."""
    b = tl.arange(0, BLOCKS)
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
        _write_row(k_ptr, row, stride_k, cell, kv_ptr, ks_ptr, stride_kv, stride_ks, 32 * k_blocks, K_BLOCKS, True)
    else:
        _write_row(v_ptr, row, stride_v, cell, vv_ptr, vs_ptr, stride_vv, stride_vs, 32 * v_blocks, V_BLOCKS, True)


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


@triton.jit
def _rotated_row(src_ptr, row, stride_src, cos_ptr, sin_ptr, stride_angle, width, head_dim, rope_dim,
                 BLOCKS: tl.constexpr, NEOX: tl.constexpr):  # fmt: skip
    """One row of heads [width = heads x head_dim] as [BLOCKS, 32] f32, the first rope_dim features of each head
    rotated as strata.stage_worker.rope.Rope.apply rotates them (in f32, then rounded to the row's dtype)."""
    columns = tl.arange(0, BLOCKS)[:, None] * 32 + tl.arange(0, 32)[None, :]
    ok = columns < width
    base = src_ptr + row * stride_src
    x = tl.load(base + columns, mask=ok, other=0.0).to(tl.float32)
    j = columns % head_dim
    if NEOX:  # the two halves of the rotated features pair up
        half = rope_dim // 2
        first = j < half
        pair = tl.where(first, j, j - half)
        partner = tl.where(first, columns + half, columns - half)
    else:  # adjacent features pair up
        first = j % 2 == 0
        pair = j // 2
        partner = columns ^ 1
    rotated = ok & (j < rope_dim)
    p = tl.load(base + partner, mask=rotated, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + row * stride_angle + pair, mask=rotated, other=1.0)
    sin = tl.load(sin_ptr + row * stride_angle + pair, mask=rotated, other=0.0)
    # (a, b) -> (a cos - b sin, a sin + b cos), in the reference's order of operations.
    y = tl.where(first, x * cos - p * sin, p * sin + x * cos)
    y = tl.where(rotated, y, x)
    return y.to(src_ptr.dtype.element_ty).to(tl.float32), columns, ok


@triton.jit
def _store_row(x, columns, ok, dst_ptr, scales_ptr, cell, stride_dst, stride_sc, width,
               BLOCKS: tl.constexpr, Q8: tl.constexpr):  # fmt: skip
    if Q8:
        _store_q8(x, tl.arange(0, BLOCKS) * 32 < width, columns, dst_ptr, scales_ptr, cell, stride_dst, stride_sc,
                  BLOCKS)  # fmt: skip
    else:
        tl.store(dst_ptr + cell * stride_dst + columns, x.to(dst_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rotate_q(q_ptr, out_ptr, row, stride_q, stride_out, cos_ptr, sin_ptr, stride_angle, q_width, head_dim, rope_dim,
              Q_BLOCKS: tl.constexpr, NEOX: tl.constexpr):  # fmt: skip
    y, columns, ok = _rotated_row(q_ptr, row, stride_q, cos_ptr, sin_ptr, stride_angle, q_width, head_dim, rope_dim,
                                  Q_BLOCKS, NEOX)  # fmt: skip
    tl.store(out_ptr + row * stride_out + columns, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _write_k(k_ptr, row, stride_k, cos_ptr, sin_ptr, stride_angle, cell, kv_ptr, ks_ptr, stride_kv, stride_ks,
             kv_width, head_dim, rope_dim,
             KV_BLOCKS: tl.constexpr, NEOX: tl.constexpr, K_Q8: tl.constexpr):  # fmt: skip
    y, columns, ok = _rotated_row(k_ptr, row, stride_k, cos_ptr, sin_ptr, stride_angle, kv_width, head_dim, rope_dim,
                                  KV_BLOCKS, NEOX)  # fmt: skip
    _store_row(y, columns, ok, kv_ptr, ks_ptr, cell, stride_kv, stride_ks, kv_width, KV_BLOCKS, K_Q8)


@triton.jit
def _write_row(v_ptr, row, stride_v, cell, vv_ptr, vs_ptr, stride_vv, stride_vs, kv_width, KV_BLOCKS: tl.constexpr,
               V_Q8: tl.constexpr):  # fmt: skip
    """One row of `kv_width` values into `cell` as it is: q8_0 (V_Q8) or the store's plain type."""
    columns = tl.arange(0, KV_BLOCKS)[:, None] * 32 + tl.arange(0, 32)[None, :]
    ok = columns < kv_width
    x = tl.load(v_ptr + row * stride_v + columns, mask=ok, other=0.0).to(tl.float32)
    _store_row(x, columns, ok, vv_ptr, vs_ptr, cell, stride_vv, stride_vs, kv_width, KV_BLOCKS, V_Q8)


@triton.jit
def _rope_write(q_ptr, k_ptr, v_ptr, out_ptr, cos_ptr, sin_ptr, cells_ptr, kv_ptr, ks_ptr, vv_ptr, vs_ptr,
                stride_q, stride_k, stride_v, stride_out, stride_angle, stride_kv, stride_ks, stride_vv, stride_vs,
                q_width, kv_width, head_dim, rope_dim,
                Q_BLOCKS: tl.constexpr, KV_BLOCKS: tl.constexpr, NEOX: tl.constexpr, K_Q8: tl.constexpr,
                V_Q8: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """Program (row, 0): k rotated into its cell; (row, 1): v into its cell; (row, 2): q rotated into out. (Each
    part in a function of its own: Triton wants a name bound in both arms of a branch to have one type.)"""
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    part = tl.program_id(1)
    if part == 2:
        _rotate_q(q_ptr, out_ptr, row, stride_q, stride_out, cos_ptr, sin_ptr, stride_angle, q_width, head_dim,
                  rope_dim, Q_BLOCKS, NEOX)  # fmt: skip
    elif part == 0:
        cell = tl.load(cells_ptr + row).to(tl.int64)
        _write_k(k_ptr, row, stride_k, cos_ptr, sin_ptr, stride_angle, cell, kv_ptr, ks_ptr, stride_kv, stride_ks,
                 kv_width, head_dim, rope_dim, KV_BLOCKS, NEOX, K_Q8)  # fmt: skip
    else:
        cell = tl.load(cells_ptr + row).to(tl.int64)
        _write_row(v_ptr, row, stride_v, cell, vv_ptr, vs_ptr, stride_vv, stride_vs, kv_width, KV_BLOCKS, V_Q8)


def rope_write(
    *,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cos: Tensor,
    sin: Tensor,
    cells: Tensor,
    k_values: Tensor,
    k_scales: Tensor | None,
    v_values: Tensor,
    v_scales: Tensor | None,
    head_dim: int,
    rope_dim: int,
    neox: bool,
) -> Tensor:
    """q [N, q_width], k and v [N, kv_width] (dense rows of heads), cos and sin [N, rope_dim / 2] f32 -> q rotated
    [N, q_width] in q's dtype; k rotated and v stored into cells [N] of the stores (q8_0 where scales are given,
    else the values' dtype)."""
    n, q_width = q.shape
    kv_width = k.shape[1]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if n == 0:
        return out
    # Plain stores have no scales: the kernel never touches the pointer it is given in their place.
    k_sc = k_values if k_scales is None else k_scales
    v_sc = v_values if v_scales is None else v_scales
    _rope_write[(n, 3)](
        q, k, v, out, cos, sin, cells, k_values, k_sc, v_values, v_sc,
        q.stride(0), k.stride(0), v.stride(0), out.stride(0), cos.stride(0), k_values.stride(0), k_sc.stride(0),
        v_values.stride(0), v_sc.stride(0), q_width, kv_width, head_dim, rope_dim,
        Q_BLOCKS=triton.next_power_of_2(triton.cdiv(q_width, 32)),
        KV_BLOCKS=triton.next_power_of_2(triton.cdiv(kv_width, 32)),
        NEOX=neox, K_Q8=k_scales is not None, V_Q8=v_scales is not None, **dependent_launch.options(q.device),
    )  # fmt: skip
    return out
