"""GGUF planes times a batch of activations on the tensor cores: the weight dequantised in registers, tile by tile.

The fused kernel of strata.stage_worker.kernels.quant_matmul_triton forms each weight value once and multiplies it by
every row of x on the CUDA cores: the right trade for a decode step of a few rows, and past about eight rows its
registers run out. Beyond that the model used to dequantise the whole matrix into x's dtype and hand it to cuBLAS,
which writes two bytes a value and reads them back every step: at 16 streams that cost more than the weights' own
bytes. This kernel reads the planes once, forms a [BLOCK_N, CHUNKS x 16] tile of values in registers with the block
readers of strata.stage_worker.kernels.quant_blocks_triton (`read_chunk`, `nibble_values`: exactly the dequantise
kernel's values), rounds it to x's dtype (as the dequantise path does), and multiplies it by the matching columns of
x with `tl.dot`. A tile's columns are the chunks' own (a K-quant's nibbles lie 32 columns apart), so x is gathered at
them, in runs of 16 columns that Triton copies ahead of the loop's compute; the scales, in loads too narrow for its
copies, are read a step ahead by hand (compiled offline with the device's Triton 3.6: no synchronous load of x or of
the scales is left in a step's path; not yet timed on a GPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType
from strata.stage_worker.kernels import dependent_launch
from strata.stage_worker.kernels.dependent_launch import wait_for_inputs
from strata.stage_worker.kernels.product_outputs_triton import product_output, store_product
from strata.stage_worker.kernels.quant_blocks_triton import (
    GATE_NONE,
    checked_rows,
    chunk_base,
    chunk_count,
    chunk_fields,
    chunk_words,
    four_columns,
    gated_load,
    kernel_planes,
    layout_constexprs,
    nibble_values,
)
from strata.stage_worker.kernels.quant_matmul_triton import TALL_N
from torch import Tensor

MAX_ROWS = 64  # rows of x one program holds ([BLOCK_N, BLOCK_M] f32 accumulators)


def default_tile(ggml_type: GGMLQuantizationType, rows: int, n: int) -> tuple[int, int, int]:
    """(block_n, chunks, num_warps), measured on an H100 over Llama-3-8B's four matrices (bench/quant_matmul.py
    --sweep): Q8_0 wants wide K steps at 16 rows and wide N tiles at 64, the K-quants narrow K steps up to 32 rows.
    On an H200 (2026-11-29, 16 rows, twelve tiles) the same won everywhere but on Q4_K's tall gate/up (n rows), which
    took 83.0 us with 128 rows a program on 8 warps against 94.4 (Q6_K's and Q8_0's lost with it: 131 and 97 us)."""
    q8 = ggml_type == GGMLQuantizationType.Q8_0
    if rows <= 16:
        if ggml_type == GGMLQuantizationType.Q4_K and n >= TALL_N:
            return (128, 4, 8)
        return (64, 8, 4) if q8 else (64, 4, 4)
    if rows <= 32:
        return (64, 4, 4)
    return (128, 4, 8) if q8 else (64, 8, 4)


@triton.jit
def _gemm(
    x_ptr, out_ptr, result_ptr, counts_ptr, q_ptr, h_ptr, d_ptr, d2_ptr, sc_ptr, mn_ptr,
    M, N, n_chunks, chunks_per_split, gate_offset,
    sxm, sos, som, sres, sq, sh, sd, sd2, ssc, smn,
    FAMILY: tl.constexpr, BITS: tl.constexpr, MINIMUMS: tl.constexpr, HALF_STRIDE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, F32_DOT: tl.constexpr, GATE: tl.constexpr,
    SPLIT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[split, m, n] = sum over the split's chunks of x[m] . W[n], a tile's products on the tensor cores (x
    formed on load from a gated feed-forward's gate and up where GATE says so: quant_blocks_triton's `gated_load`),
    and with SPLIT their sum into result [m, n] (`sum_splits`)."""
    NIBBLES: tl.constexpr = 1 if HALF_STRIDE == 0 else 2
    HIGH: tl.constexpr = FAMILY == 3 or BITS == 5  # high-bit words of their own (Q5 types, Q6_K)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_in = tl.minimum(rows, N - 1)  # rows past N read row N - 1 and are not stored
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    offs_c = tl.arange(0, CHUNKS)
    offs_w = tl.arange(0, 4 * CHUNKS)
    offs_j = tl.arange(0, CHUNKS * 16)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    wait_for_inputs(PDL)
    first = pid_k * chunks_per_split
    last = tl.minimum(first + chunks_per_split, n_chunks)
    # Each step's scales (and high bits) are read a step ahead (the last step's read is all masked): their loads are
    # too narrow for Triton's asynchronous copies, and read in the step that used them, each step waited for them.
    # The main words are wide: Triton's pipeline copies them ahead.
    high, a_lo, b_lo, a_hi, b_hi = chunk_fields(
        FAMILY, BITS, MINIMUMS, h_ptr, d_ptr, d2_ptr, sc_ptr, mn_ptr, sh, sd, sd2, ssc, smn, rows_in, first + offs_c,
        first + offs_c < last,
    )  # fmt: skip
    for k0 in range(first, last, CHUNKS):
        ahead = k0 + CHUNKS + offs_c
        next_high, next_a_lo, next_b_lo, next_a_hi, next_b_hi = chunk_fields(
            FAMILY, BITS, MINIMUMS, h_ptr, d_ptr, d2_ptr, sc_ptr, mn_ptr, sh, sd, sd2, ssc, smn, rows_in, ahead,
            ahead < last,
        )  # fmt: skip
        flat = 4 * k0 + offs_w
        words = chunk_words(FAMILY, q_ptr, sq, rows_in, k0 + offs_c, flat, flat < 4 * last)
        w0, w1, w2, w3 = four_columns(words)
        if HIGH:
            h0, h1, h2, h3 = four_columns(high)
        else:
            h0, h1, h2, h3 = w0, w1, w2, w3  # `value_pair` reads the main words alone there
        chunk_of_column = k0 + offs_j // 16  # [C x 16]
        for h in tl.static_range(NIBBLES):
            value = nibble_values(FAMILY, BITS, w0, w1, w2, w3, h0, h1, h2, h3, a_lo, b_lo, a_hi, b_hi, h, BLOCK_N,
                                   CHUNKS)  # fmt: skip
            w = tl.reshape(value, (BLOCK_N, CHUNKS * 16)).to(x_ptr.dtype.element_ty)
            # Each chunk's 16 columns from a flat range, not reshaped from [C, 16]: so Triton sees runs of 16
            # contiguous columns and loads x in 16-byte pieces (asynchronously, ahead of the loop's compute).
            column = chunk_base(FAMILY, chunk_of_column) + HALF_STRIDE * h + offs_j % 16
            column_ok = chunk_of_column < last
            xt = gated_load(
                x_ptr + m[None, :] * sxm + column[:, None], column_ok[:, None] & m_ok[None, :], gate_offset, GATE
            )  # [C x 16, BLOCK_M]
            if F32_DOT:
                acc += tl.dot(w, xt, input_precision="ieee")
            else:
                acc += tl.dot(w, xt)
        high, a_lo, b_lo, a_hi, b_hi = next_high, next_a_lo, next_b_lo, next_a_hi, next_b_hi
    # [BLOCK_M, BLOCK_N], as `store_product` takes a program's outputs
    store_product(out_ptr, result_ptr, counts_ptr, tl.trans(acc), m, M, rows, N, pid_n, pid_k, 0, sos, som, sres,
                  BLOCK_M, BLOCK_N, GATE_NONE, SPLIT)  # fmt: skip


def quant_gemm(
    x: Tensor,
    planes: Sequence[Tensor],
    ggml_type: GGMLQuantizationType,
    *,
    columns: int,
    block_n: int | None = None,
    chunks: int | None = None,
    num_warps: int | None = None,
    splits: int | None = None,
    gate: int = 0,
) -> Tensor:
    """x [M, K] (M <= MAX_ROWS) @ W.T -> [M, N] in x's dtype, W given as its planes (formats.plane_names order);
    the tile is `default_tile`'s where not given, the split along K `product_output`'s. With a `gate`, x is [M, 2K] as
    quant_matmul_triton.quant_matmul takes it."""
    x = checked_rows(x, columns=columns * (2 if gate else 1), most=MAX_ROWS, kernel="tensor-core")
    m_rows, n = x.shape[0], planes[0].shape[0]
    if m_rows == 0:
        return x.new_empty((0, n))
    tile = default_tile(ggml_type, m_rows, n)
    block_n, chunks, num_warps = block_n or tile[0], chunks or tile[1], num_warps or tile[2]
    n_chunks = chunk_count(columns, ggml_type)
    chunks = min(chunks, triton.next_power_of_2(n_chunks))
    programs, chunks_per_split, out = product_output(
        x, n=n, n_chunks=n_chunks, chunks=chunks, block_n=block_n, splits=splits, activate=GATE_NONE
    )  # fmt: skip
    slots, strides = kernel_planes(planes, ggml_type)
    _gemm[(programs, out.splits)](
        x, out.parts, out.result, out.counts, *slots, m_rows, n, n_chunks, chunks_per_split, columns,
        x.stride(0), out.split_stride, out.parts.stride(-2), out.result.stride(0), *strides,
        **layout_constexprs(ggml_type), BLOCK_M=max(16, triton.next_power_of_2(m_rows)), BLOCK_N=block_n, CHUNKS=chunks,
        F32_DOT=x.dtype == torch.float32, GATE=gate, SPLIT=out.splits > 1, num_warps=num_warps,
        **dependent_launch.options(x.device),
    )  # fmt: skip
    return out.result
