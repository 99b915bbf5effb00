"""GGUF-quantised weights times activations in Triton, reading the planes of strata.stage_worker.weights.formats in
place through the block readers of strata.stage_worker.kernels.quant_blocks_triton: a fused dequantise-and-dot for
decode (a few rows of x), and a dequantise into a dense tensor for prefill.

Why a kernel of our own: a decode step is the weights' bytes over memory bandwidth, and a 4-bit weight read as bf16
is 3.5 times the bytes. The fused kernel reads each quantised byte once, as llama.cpp's mul_mat_vec_q does.

Per sub-block, sum (a u + b) x = a 2^24 sum((u 2^-24) x) + b sum(x): the decode kernel multiplies by x (one FMA a
value) and applies the scales once per chunk. Each product of a bf16 or f16 x is exact in f32. x is loaded as [rows of
x, chunks, 8]: the same lanes as the chunks, each reading eight consecutive values of x in one load, used by every row
of the program. Measured with ncu on an H100 (Triton 3.6), layout conversions through shared memory, not the weights'
bytes, once bounded the kernel (L1 85-92% busy, DRAM 29-40%); reading chunks along the lanes removed them (Q4_K at one
row: 29% -> 71% of a measured read). Scale planes are read as wider words (`SCALE_WORDS`) to load each chunk's scales
once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType
from strata.stage_worker.kernels import dependent_launch
from strata.stage_worker.kernels.dependent_launch import wait_for_inputs
from strata.stage_worker.kernels.product_outputs_triton import product_output, program_rows, store_product
from strata.stage_worker.kernels.quant_blocks_triton import (
    LAYOUTS,
    NORM_ADD_RMS,
    NORM_NONE,
    NORM_RMS,
    Q,
    checked_rows,
    chunk_count,
    four_columns,
    kernel_planes,
    layout_constexprs,
    nibble_values,
    normed_values,
    pair_columns,
    read_chunk,
    unit_of,
    value_pair,
    x_values,
)
from torch import Tensor


@triton.jit
def _gemv(
    x_ptr, out_ptr, result_ptr, counts_ptr, q_ptr, h_ptr, d_ptr, d2_ptr, sc_ptr, mn_ptr, r_ptr, g_ptr, hs_ptr,
    M, N, n_chunks, chunks_per_split, columns, eps, half_n,
    sxm, sos, som, sres, sq, sh, sd, sd2, ssc, smn, srm, shm,
    FAMILY: tl.constexpr, BITS: tl.constexpr, MINIMUMS: tl.constexpr, HALF_STRIDE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, EVEN_K: tl.constexpr, GATE: tl.constexpr,
    NORM: tl.constexpr, SPLIT: tl.constexpr, PAIRED: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[split, m, n] = sum over the split's chunks of x[m] . W[n], and with SPLIT their sum into result [m, n]
    (`sum_splits`), for the M (<= BLOCK_M) rows of x at once
    (x formed on load from a gated feed-forward's gate and up where GATE says so: quant_blocks_triton's
    `gated_load`; or x's RMS norm times g, of x + r stored at hs where NORM says so, in one split:
    `normed_values`).

    PAIRED (a GATE_ constant): W is a gated feed-forward's gate rows [0, half_n) over its up rows [half_n, N), each
    program takes BLOCK_N / 2 gate rows and the matching up rows, and out [m, half_n] is act(gate) * up of its
    outputs, each rounded to out's dtype first as a product's output is (one split).

    One row of x: the sums of (u 2^-24) x and of x per sub-block half, scaled once a chunk. More rows: each value
    a u + b is formed once (one FMA) and multiplied by every row's x."""
    NIBBLES: tl.constexpr = 1 if HALF_STRIDE == 0 else 2
    SPLIT_HALVES: tl.constexpr = FAMILY >= 2  # a K-quant's nibbles lie in different sub-blocks
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = program_rows(pid_n, half_n, N, BLOCK_N, PAIRED)
    rows_in = tl.minimum(rows, N - 1)  # rows past N read row N - 1 and are not stored: no masked weight loads
    m = tl.arange(0, BLOCK_M)
    row = tl.minimum(m, M - 1)[None, :, None]
    x_rows = x_ptr + row * sxm  # [1, BLOCK_M, 1]: see `x_values`
    r_rows = r_ptr + row * srm
    h_rows = hs_ptr + row * shm
    stores_h = (m < tl.where(pid_n + pid_k == 0, M, 0))[None, :, None]  # one program writes h, its real rows
    squares = tl.zeros((BLOCK_M, CHUNKS), dtype=tl.float32)
    offs_c = tl.arange(0, CHUNKS)
    offs_w = tl.arange(0, 4 * CHUNKS)
    eight = tl.arange(0, 8)[None, None, :]
    if BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N, CHUNKS), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, CHUNKS), dtype=tl.float32)
    first = pid_k * chunks_per_split
    last = tl.minimum(first + chunks_per_split, n_chunks)
    wait_for_inputs(PDL)
    for k0 in range(first, last, CHUNKS):
        kc = k0 + offs_c
        kmask = (kc < last) | EVEN_K
        flat = 4 * k0 + offs_w
        words, high, a_lo, b_lo, a_hi, b_hi, base = read_chunk(
            FAMILY, BITS, MINIMUMS, q_ptr, h_ptr, d_ptr, d2_ptr, sc_ptr, mn_ptr, sq, sh, sd, sd2, ssc, smn,
            rows_in, kc, kmask, flat, (flat < 4 * last) | EVEN_K,
        )  # fmt: skip
        word_columns = four_columns(words)
        high_columns = four_columns(high)
        xmask = kmask[:, None, None] & (eight < 8)
        if BLOCK_M == 1:
            f_lo = tl.zeros((BLOCK_N, CHUNKS), dtype=tl.float32)
            f_hi = tl.zeros((BLOCK_N, CHUNKS), dtype=tl.float32)
            x_lo = tl.zeros((1, CHUNKS), dtype=tl.float32)
            x_hi = tl.zeros((1, CHUNKS), dtype=tl.float32)
        for h in tl.static_range(NIBBLES):
            # A nibble's 16 values of x are consecutive columns: two 16-byte loads, words 0-1 and 2-3.
            column = base[:, None, None] + HALF_STRIDE * h + eight
            if NORM == NORM_NONE:
                first_x = x_values(x_rows + column, xmask, columns, GATE)
                last_x = x_values(x_rows + column + 8, xmask, columns, GATE)
            else:
                first_x, first_squares = normed_values(
                    x_rows + column, xmask, r_rows + column, g_ptr + column, h_rows + column, stores_h, NORM
                )
                last_x, last_squares = normed_values(
                    x_rows + column + 8, xmask, r_rows + column + 8, g_ptr + column + 8, h_rows + column + 8,
                    stores_h, NORM,
                )  # fmt: skip
                squares += first_squares + last_squares
            first_words = pair_columns(first_x)
            last_words = pair_columns(last_x)
            for i in tl.static_range(4):
                x_columns = first_words[i] if i < 2 else last_words[i - 2]
                if SPLIT_HALVES and h == 1:
                    scale = a_hi * unit_of(BITS, h)
                    offset = b_hi
                else:
                    scale = a_lo * unit_of(BITS, h)
                    offset = b_lo
                for t in tl.static_range(2):
                    f_a, f_b = value_pair(FAMILY, BITS, word_columns[i], high_columns[i], t, h)
                    x_a = x_columns[t]
                    x_b = x_columns[t + 2]
                    # One statement a product: each compiles to one FMA.
                    if BLOCK_M > 1:
                        acc += (scale * f_a + offset)[None, :, :] * x_a[:, None, :]
                        acc += (scale * f_b + offset)[None, :, :] * x_b[:, None, :]
                    elif h == 1:
                        f_hi += f_a * x_a
                        f_hi += f_b * x_b
                        x_hi += x_a
                        x_hi += x_b
                    else:
                        f_lo += f_a * x_a
                        f_lo += f_b * x_b
                        x_lo += x_a
                        x_lo += x_b
        if BLOCK_M == 1:
            acc += a_lo * unit_of(BITS, 0) * f_lo + b_lo * x_lo
            if NIBBLES == 2:
                acc += a_hi * unit_of(BITS, 1) * f_hi + b_hi * x_hi
    out = tl.sum(acc, axis=1)[None, :] if BLOCK_M == 1 else tl.sum(acc, axis=2)
    if NORM != NORM_NONE:
        out = out * tl.rsqrt(tl.sum(squares, axis=1) / columns + eps)[:, None]
    store_product(out_ptr, result_ptr, counts_ptr, out, m, M, rows, N, pid_n, pid_k, half_n, sos, som, sres,
                  BLOCK_M, BLOCK_N, PAIRED, SPLIT)  # fmt: skip


@triton.jit
def _dequantise(
    out_ptr, q_ptr, h_ptr, d_ptr, d2_ptr, sc_ptr, mn_ptr,
    N, n_chunks,
    so, sq, sh, sd, sd2, ssc, smn,
    FAMILY: tl.constexpr, BITS: tl.constexpr, MINIMUMS: tl.constexpr, HALF_STRIDE: tl.constexpr,
    BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr,
):  # fmt: skip
    """out[n, k] = the weight's value, a u + b in one FMA (the reference's one rounding: a u is exact), in out's
    dtype."""
    NIBBLES: tl.constexpr = 1 if HALF_STRIDE == 0 else 2
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_in = tl.minimum(rows, N - 1)
    kc = pid_k * CHUNKS + tl.arange(0, CHUNKS)
    kmask = kc < n_chunks
    flat = 4 * pid_k * CHUNKS + tl.arange(0, 4 * CHUNKS)
    words, high, a_lo, b_lo, a_hi, b_hi, base = read_chunk(
        FAMILY, BITS, MINIMUMS, q_ptr, h_ptr, d_ptr, d2_ptr, sc_ptr, mn_ptr, sq, sh, sd, sd2, ssc, smn,
        rows_in, kc, kmask, flat, flat < 4 * n_chunks,
    )  # fmt: skip
    w0, w1, w2, w3 = four_columns(words)
    h0, h1, h2, h3 = four_columns(high)
    sixteen = tl.arange(0, 16)[None, None, :]
    mask = (rows < N)[:, None, None] & kmask[None, :, None] & (sixteen < 16)
    for h in tl.static_range(NIBBLES):
        # Each lane stores a chunk's 16 values of nibble h, consecutive columns: 32 contiguous bytes (whole sectors;
        # four values a store left L2 merging quarters).
        value = nibble_values(FAMILY, BITS, w0, w1, w2, w3, h0, h1, h2, h3, a_lo, b_lo, a_hi, b_hi, h, BLOCK_N, CHUNKS)
        column = base[None, :, None] + HALF_STRIDE * h + sixteen
        tl.store(out_ptr + rows[:, None, None] * so + column, value.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class Config:
    """A launch shape; bench/quant_matmul.py --sweep measures the alternatives. None: `default_config`'s."""

    block_n: int | None = None  # weight rows a program (each lane holds all of them)
    chunks: int | None = None  # chunks a step along K: 32 lanes x warps (x chunks a lane)
    num_warps: int | None = None
    splits: int | None = None  # programs along K; None: enough for WAVES programs a multiprocessor


MAX_ROWS = 16  # rows of x the fused kernel takes (its registers hold them all)


# A matrix this many columns wide or wider is a down projection (Llama-3-8B's 14,336); this many rows or more, a
# gate/up projection or an output head.
WIDE_K = 8192
TALL_N = 16384


def default_config(ggml_type: GGMLQuantizationType, rows: int, *, n: int, k: int) -> Config:
    """Measured (bench/quant_matmul.py --sweep, Llama-3-8B's matrices, H100, 2026-11-27; µs per call at one row).
    Several rows of x: 8 weight rows a program, as many as the x rows' registers permit. One row, by type and shape:
    Q8_0 2 chunks a lane and 4 rows a program, but one chunk a lane for the wide down projection (24.3 against 28.3)
    and 8 rows for the tall gate/up (43.6 against 45.3); 4-bit types 8 rows a lane and 2 warps, the down projection
    4 rows and 2 chunks a lane (19.4 against 20.3); Q6_K 2 rows and 2 warps (gate_up 39.8 against 46.3, o 7.9
    against 10.1), 4 rows and 2 warps for the down projection; Q5 types (not swept again) 4 rows, a chunk a lane."""
    if rows > 1:
        return Config(block_n=8, chunks=128, num_warps=4)
    wide, tall = k >= WIDE_K, n >= TALL_N
    if ggml_type == Q.Q8_0:
        return Config(4, 128, 4) if wide else Config(8, 128, 4) if tall else Config(4, 256, 4)
    if LAYOUTS[ggml_type].bits == 4:
        return Config(4, 256, 4) if wide else Config(8, 64, 2)
    if ggml_type == Q.Q6_K:
        return Config(4, 64, 2) if wide else Config(2, 128, 2)
    return Config(block_n=4, chunks=128, num_warps=4)


@dataclass(frozen=True)
class Norm:
    """x's RMS norm before the product: x (+ `residual`) scaled by 1 / rms and by `weight` [K] (quant_blocks_triton's
    NORM_ constants)."""

    weight: Tensor
    eps: float
    residual: Tensor | None = None  # [M, K]: the product takes the norm of h = x + residual, and h is returned


def quant_matmul(
    x: Tensor,
    planes: Sequence[Tensor],
    ggml_type: GGMLQuantizationType,
    *,
    columns: int,
    config: Config | None = None,
    gate: int = 0,
    activate: int = 0,
) -> Tensor:
    """x [M, K] (M <= 16) @ W.T -> [M, N] in x's dtype, W given as its planes (formats.plane_names order). With a
    `gate` (quant_blocks_triton's GATE_SILU or GATE_GELU_TANH), x is a gated feed-forward's [M, 2K] gate and up, and
    the product is act(gate) * up @ W.T. With `activate`, W is that feed-forward's gate rows over its up rows, and
    the product act(gate) * up of x @ W.T [M, N / 2] (one split)."""
    if activate:
        config = replace(config or Config(), splits=1)
    out, _ = _launch(x, planes, ggml_type, columns=columns, config=config, gate=gate, norm=None, activate=activate)
    return out


def quant_matmul_normed(
    x: Tensor,
    planes: Sequence[Tensor],
    ggml_type: GGMLQuantizationType,
    *,
    columns: int,
    norm: Norm,
    config: Config | None = None,
    activate: int = 0,
) -> tuple[Tensor, Tensor | None]:
    """(rms_norm(h) * norm.weight @ W.T, h) with h = x + norm.residual (None without a residual: h is x), x [M, K]
    (M <= 16), in one split along K (a program needs all of a row's squares). With `activate` (GATE_SILU or
    GATE_GELU_TANH), W is a gated feed-forward's gate rows over its up rows, and the product is act(gate) * up
    [M, N / 2], formed as the programs store it: no launch of its own."""
    return _launch(x, planes, ggml_type, columns=columns, config=replace(config or Config(), splits=1), gate=0,
                   norm=norm, activate=activate)  # fmt: skip


def _launch(
    x: Tensor,
    planes: Sequence[Tensor],
    ggml_type: GGMLQuantizationType,
    *,
    columns: int,
    config: Config | None,
    gate: int,
    norm: Norm | None,
    activate: int = 0,
) -> tuple[Tensor, Tensor | None]:
    x = checked_rows(x, columns=columns * (2 if gate else 1), most=MAX_ROWS, kernel="fused")
    m_rows, n = x.shape[0], planes[0].shape[0]
    residual = None if norm is None else norm.residual
    h = None if residual is None else torch.empty_like(x)
    if m_rows == 0:
        return x.new_empty((0, n)), h
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"the residual is {tuple(residual.shape)}, x {tuple(x.shape)}")
    n_chunks = chunk_count(columns, ggml_type)
    default = default_config(ggml_type, m_rows, n=n, k=columns)
    config = config or default
    block_n = config.block_n or default.block_n or 4
    warps = config.num_warps or default.num_warps or 4
    chunks = min(config.chunks or default.chunks or 128, triton.next_power_of_2(n_chunks))
    programs, chunks_per_split, out = product_output(
        x, n=n, n_chunks=n_chunks, chunks=chunks, block_n=block_n, splits=config.splits, activate=activate
    )  # fmt: skip
    parts, splits = out.parts, out.splits
    slots, strides = kernel_planes(planes, ggml_type)
    r = x if residual is None else checked_rows(residual, columns=columns, most=MAX_ROWS, kernel="fused")
    _gemv[(programs, splits)](
        x, parts, out.result, out.counts, *slots, r, x if norm is None else norm.weight, x if h is None else h,
        m_rows, n, n_chunks, chunks_per_split, columns, 0.0 if norm is None else norm.eps, n // 2,
        x.stride(0), out.split_stride, parts.stride(-2), out.result.stride(0), *strides,
        r.stride(0),
        x.stride(0) if h is None else h.stride(0),
        **layout_constexprs(ggml_type), BLOCK_M=triton.next_power_of_2(m_rows), BLOCK_N=block_n, CHUNKS=chunks,
        EVEN_K=n_chunks % chunks_per_split == 0 and chunks_per_split % chunks == 0, GATE=gate,
        NORM=(NORM_NONE if norm is None else NORM_RMS if residual is None else NORM_ADD_RMS).value, SPLIT=splits > 1,
        PAIRED=activate, num_warps=warps, num_stages=1, **dependent_launch.options(x.device),
    )  # fmt: skip
    return out.result, h


def dequantize(
    planes: Sequence[Tensor], ggml_type: GGMLQuantizationType, *, columns: int, dtype: torch.dtype
) -> Tensor:
    """The weight [N, K] in `dtype` (each value computed as the f32 reference computes it, then rounded)."""
    n = planes[0].shape[0]
    n_chunks = chunk_count(columns, ggml_type)
    out = torch.empty((n, columns), device=planes[0].device, dtype=dtype)
    block_n, chunks = 4, min(128, triton.next_power_of_2(n_chunks))
    slots, strides = kernel_planes(planes, ggml_type)
    grid = (triton.cdiv(n, block_n), triton.cdiv(n_chunks, chunks))
    _dequantise[grid](
        out, *slots, n, n_chunks, out.stride(0), *strides,
        **layout_constexprs(ggml_type), BLOCK_N=block_n, CHUNKS=chunks, num_warps=4,
    )  # fmt: skip
    return out
