"""GGUF weights times a few rows of x quantised to 8 bits, with integer dot products (dp4a), as llama.cpp's
mul_mat_vec_q does: a candidate for decode steps of 2-4 rows, where the fused kernel (quant_matmul_triton) issues
about 2.2 instructions a weight and a row (a value formed, then one FMA a row) and is bound by that (compiled with
the device's Triton 3.6: docs/benchmarks.md). Q8_0, Q4_K and Q6_K: every tensor of the Q8_0 and Q4_K_M files.

x [M, K] is quantised first (`quantise_rows`, a launch of its own): each block of 32 values to int8 q with one f32
scale d = max|x| / 127 (q = round(x / d), within half a step of x / d: on a GPU the division rounds once more) and
its sum s = d sum(q). The product is then exactly that of x's rounded values x_q = d q with the weight (`reference`),
in f32: per block of 32 weights of scale a and offset b (w = a u + b), sum(w x_q) = a d sum(u q) + b s, eight dp4a
(four products each) a block and a row.

Decode steps of 2-4 rows of bf16 x take it for matrices of 2^25 weights or more (quant_matmul.product_path): on an
H200 it multiplies 4 rows of Llama-3-8B's gate_up 1.4-1.8x faster than the fused kernel, and 4 streams decode 1.46x
llama.cpp's speed (docs/benchmarks.md). Its error against the exact product is about twice the fused kernel's (x's
rounding to 8 bits, as llama.cpp's q8_1 activations round), within the bf16 tolerance of the matmul tests, not
within f16's; f32 and f16 x keep the fused kernel.

The tile follows the fused kernel's rule: every tensor of the loop has its chunks along the lanes, each lane's chunk
of a row in its registers (two 16-byte loads of the weights' 32 bytes), so no use converts layouts. A chunk is one
Q8_0 block (32 values, one block of x), or one Q4_K pair of sub-blocks (64 values: the low nibbles are the first
sub-block's, the high the second's; two blocks of x).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType
from strata.stage_worker.kernels import dependent_launch
from strata.stage_worker.kernels.dependent_launch import wait_for_inputs
from strata.stage_worker.kernels.product_outputs_triton import product_output, program_rows, store_product
from strata.stage_worker.kernels.quant_blocks_triton import (
    as_words,
    four_columns,
    per_chunk,
)
from strata.stage_worker.weights.formats import dequantize, plane_names
from torch import Tensor

Q = GGMLQuantizationType
BLOCK = 32  # values a block of quantised x
FAMILIES = {Q.Q8_0: 0, Q.Q4_K: 1, Q.Q6_K: 2}
MAX_ROWS = 4
NIBBLES: tl.constexpr = tl.constexpr(0x0F0F0F0F)
TWO_BITS: tl.constexpr = tl.constexpr(0x03030303)


@triton.jit
def _dp4a(a, b):
    """The sum of the products of the four int8 of a and of b, in plain integer arithmetic."""
    total = ((a << 24) >> 24) * ((b << 24) >> 24)
    total += ((a << 16) >> 24) * ((b << 16) >> 24)
    total += ((a << 8) >> 24) * ((b << 8) >> 24)
    return total + (a >> 24) * (b >> 24)


@triton.jit
def _dot4(w, x, PTX: tl.constexpr):
    """The integer dot product of 16 weights and 16 values of x: w [BN, C, 4] and x [M, C, 4] int32 words of four
    int8 -> [M, BN, C] int32. PTX: four chained dp4a (an NVIDIA GPU); otherwise the same sum in plain integer
    arithmetic (the interpreter)."""
    w0, w1, w2, w3 = four_columns(w)
    x0, x1, x2, x3 = four_columns(x)
    if PTX:
        return tl.inline_asm_elementwise(
            "dp4a.s32.s32 $0, $1, $5, 0; dp4a.s32.s32 $0, $2, $6, $0; dp4a.s32.s32 $0, $3, $7, $0; "
            "dp4a.s32.s32 $0, $4, $8, $0;",
            "=r,r,r,r,r,r,r,r,r",
            [w0[None], w1[None], w2[None], w3[None], x0[:, None], x1[:, None], x2[:, None], x3[:, None]],
            dtype=tl.int32, is_pure=True, pack=1,
        )  # fmt: skip
    total = _dp4a(w0[None], x0[:, None]) + _dp4a(w1[None], x1[:, None])
    return total + _dp4a(w2[None], x2[:, None]) + _dp4a(w3[None], x3[:, None])


@triton.jit
def _dot_block(w_first, w_second, x_first, x_second, PTX: tl.constexpr):
    """The same over 32 (words 0-3 and 4-7 of w and x): eight chained dp4a, one addition fewer than two `_dot4`."""
    if PTX:
        w0, w1, w2, w3 = four_columns(w_first)
        w4, w5, w6, w7 = four_columns(w_second)
        x0, x1, x2, x3 = four_columns(x_first)
        x4, x5, x6, x7 = four_columns(x_second)
        return tl.inline_asm_elementwise(
            "dp4a.s32.s32 $0, $1, $9, 0; dp4a.s32.s32 $0, $2, $10, $0; dp4a.s32.s32 $0, $3, $11, $0; "
            "dp4a.s32.s32 $0, $4, $12, $0; dp4a.s32.s32 $0, $5, $13, $0; dp4a.s32.s32 $0, $6, $14, $0; "
            "dp4a.s32.s32 $0, $7, $15, $0; dp4a.s32.s32 $0, $8, $16, $0;",
            "=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
            [w0[None], w1[None], w2[None], w3[None], w4[None], w5[None], w6[None], w7[None],
             x0[:, None], x1[:, None], x2[:, None], x3[:, None], x4[:, None], x5[:, None], x6[:, None],
             x7[:, None]],
            dtype=tl.int32, is_pure=True, pack=1,
        )  # fmt: skip
    return _dot4(w_first, x_first, PTX) + _dot4(w_second, x_second, PTX)


@triton.jit
def _halves(row_ptrs, offsets, mask, ROWS: tl.constexpr, CHUNKS: tl.constexpr):
    """Words 0-3 and 4-7 of each row's chunks, [ROWS, CHUNKS, 4] each: row_ptrs [ROWS, 1] at the first chunk's
    first word, offsets [4 CHUNKS] each chunk's words 0-3 (two 16-byte loads a lane)."""
    at = row_ptrs + offsets[None, :]
    first = tl.reshape(tl.load(at, mask=mask[None, :], other=0), (ROWS, CHUNKS, 4))
    second = tl.reshape(tl.load(at + 4, mask=mask[None, :], other=0), (ROWS, CHUNKS, 4))
    return first, second


@triton.jit
def _quantise(x_ptr, q_ptr, d_ptr, s_ptr, n_blocks, sxm, sqm, sdm, CHUNKS: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    m = tl.program_id(0)
    blocks = tl.program_id(1) * CHUNKS + tl.arange(0, CHUNKS)
    ok = blocks < n_blocks
    columns = blocks[:, None] * 32 + tl.arange(0, 32)[None, :]
    values = tl.load(x_ptr + m * sxm + columns, mask=ok[:, None], other=0.0).to(tl.float32)
    top = tl.max(tl.abs(values), axis=1)
    inverse = tl.where(top > 0, 127.0 / tl.maximum(top, 1e-30), 0.0)  # 1e-30: no division by zero where unused
    q = tl.floor(values * inverse[:, None] + 0.5).to(tl.int32)
    shifts = tl.arange(0, 4) * 8
    words = tl.sum(tl.reshape(q & 255, (CHUNKS, 8, 4)) << shifts[None, None, :], axis=2)
    tl.store(q_ptr + m * sqm + blocks[:, None] * 8 + tl.arange(0, 8)[None, :], words, mask=ok[:, None])
    d = top / 127.0
    tl.store(d_ptr + m * sdm + blocks, d, mask=ok)
    tl.store(s_ptr + m * sdm + blocks, d * tl.sum(q, axis=1).to(tl.float32), mask=ok)


def quantise_rows(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x [M, K] (K a multiple of 32) -> (q as int32 words [M, K / 4], d and s [M, K / 32] f32)."""
    m, k = x.shape
    if k % BLOCK:
        raise ValueError(f"x has {k} columns, not whole blocks of {BLOCK}")
    n_blocks = k // BLOCK
    q = torch.empty((m, k // 4), dtype=torch.int32, device=x.device)
    d = torch.empty((m, n_blocks), dtype=torch.float32, device=x.device)
    s = torch.empty_like(d)
    chunks = 32
    _quantise[(m, triton.cdiv(n_blocks, chunks))](
        x, q, d, s, n_blocks, x.stride(0), q.stride(0), d.stride(0), CHUNKS=chunks,
        **dependent_launch.options(x.device),
    )  # fmt: skip
    return q, d, s


def dequantised_rows(q: Tensor, d: Tensor) -> Tensor:
    """`quantise_rows`' q words and scales back to x's rounded values d q, [M, K] f32."""
    shifts = torch.arange(0, 32, 8, device=q.device, dtype=torch.int32)
    values = ((q[:, :, None] << (24 - shifts)) >> 24).reshape(q.shape[0], -1, BLOCK)  # each int8, sign-extended
    return (values.float() * d[:, :, None]).reshape(q.shape[0], -1)


def reference(x: Tensor, planes: Sequence[Tensor], ggml_type: GGMLQuantizationType) -> Tensor:
    """The function the kernel computes, in torch and f32: x's rounded values (as `quantise_rows` made them) times
    the dequantised weight."""
    q, d, _ = quantise_rows(x)
    weight = dequantize(dict(zip(plane_names(ggml_type), planes, strict=True)), ggml_type)
    return dequantised_rows(q, d).cpu() @ weight.T.cpu()


@triton.jit
def _sum4(x, PTX: tl.constexpr):
    """The sum of the 16 int8 of x [M, C, 4] (four words) -> [M, C] int32."""
    x0, x1, x2, x3 = four_columns(x)
    if PTX:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 ones; mov.b32 ones, 0x01010101; dp4a.s32.s32 $0, $1, ones, 0; "
            "dp4a.s32.s32 $0, $2, ones, $0; dp4a.s32.s32 $0, $3, ones, $0; dp4a.s32.s32 $0, $4, ones, $0; }",
            "=r,r,r,r,r", [x0, x1, x2, x3], dtype=tl.int32, is_pure=True, pack=1,
        )  # fmt: skip
    return _bytes(x0) + _bytes(x1) + _bytes(x2) + _bytes(x3)


@triton.jit
def _bytes(a):
    """The sum of the four int8 of a, in plain integer arithmetic."""
    return ((a << 24) >> 24) + ((a << 16) >> 24) + ((a << 8) >> 24) + (a >> 24)


@triton.jit
def _q4_k_chunk(w_first, w_second, x_at, x_offsets, word_ok, xd_ptr, xs_ptr, m_in, sxd, chunks, chunk_ok,
                d_ptr, d2_ptr, sd, sc_ptr, mn_ptr, ssc, rows_in,
                BLOCK_M: tl.constexpr, CHUNKS: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    """A Q4_K chunk (a pair of sub-blocks: the low nibbles the first's 32 values, the high the second's) against its
    two blocks of x: [M, BN, C]. value = d sc u - dmin m; sum(value x_q) = d sc d_x sum(u q) - dmin m s_x."""
    x_first, x_second = _halves(x_at, x_offsets, word_ok, BLOCK_M, CHUNKS)
    low = _dot_block(w_first & NIBBLES, w_second & NIBBLES, x_first, x_second, PTX).to(tl.float32)
    x_first, x_second = _halves(x_at + 8, x_offsets, word_ok, BLOCK_M, CHUNKS)
    high = _dot_block((w_first >> 4) & NIBBLES, (w_second >> 4) & NIBBLES, x_first, x_second, PTX).to(tl.float32)
    # The [rows, chunks] fields through `per_chunk`, so their chunks lie along the lanes as the words' do.
    d_x = per_chunk(xd_ptr, m_in, sxd, 2 * chunks, chunk_ok, 0.0)  # [M, C]: the chunk's first block of x
    d_x2 = per_chunk(xd_ptr, m_in, sxd, 2 * chunks + 1, chunk_ok, 0.0)
    s_x = per_chunk(xs_ptr, m_in, sxd, 2 * chunks, chunk_ok, 0.0)
    s_x2 = per_chunk(xs_ptr, m_in, sxd, 2 * chunks + 1, chunk_ok, 0.0)
    d = per_chunk(d_ptr, rows_in, sd, chunks // 4, chunk_ok, 0.0).to(tl.float32)  # [BN, C]: its super-block's
    dmin = per_chunk(d2_ptr, rows_in, sd, chunks // 4, chunk_ok, 0.0).to(tl.float32)
    sc = per_chunk(sc_ptr, rows_in, ssc, chunks, chunk_ok, 0).to(tl.int32)
    mn = per_chunk(mn_ptr, rows_in, ssc, chunks, chunk_ok, 0).to(tl.int32)
    scale, scale2 = d * (sc & 255).to(tl.float32), d * ((sc >> 8) & 255).to(tl.float32)
    offset, offset2 = dmin * (mn & 255).to(tl.float32), dmin * ((mn >> 8) & 255).to(tl.float32)
    total = low * (scale[None, :, :] * d_x[:, None, :]) - offset[None, :, :] * s_x[:, None, :]
    return total + high * (scale2[None, :, :] * d_x2[:, None, :]) - offset2[None, :, :] * s_x2[:, None, :]


@triton.jit
def _q6_k_chunk(ql_first, ql_second, x_at, chunk_of_word, lane_words, word_ok, xd_ptr, m_in, sxd, chunks, chunk_ok,
                h_at, d_ptr, sd, sc_ptr, ssc, rows_in,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    """A Q6_K chunk against its two blocks of x: [M, BN, C]. Chunk c = 4 b + 2 h + p of super-block b holds values
    128 h + 32 s + l for s = p and p + 2: their low 4 bits in its 32 ql bytes (the low nibbles s = p's, the high
    s = p + 2's), their top 2 bits in qh bytes 32 h + l (bits 2 s), one int8 scale each 16 values; value =
    d sc (u - 32), and sum(value x_q) = d d_x sum over the halves of sc (sum(u q) - 32 sum(q))."""
    parity = chunks % 2  # [C]
    qh_offsets = (chunk_of_word // 2) * 8 + lane_words % 4  # a pair of chunks shares its 8 qh words
    qh_first, qh_second = _halves(h_at, qh_offsets, word_ok, BLOCK_N, CHUNKS)
    x_offsets = chunk_of_word * 16 - (chunk_of_word % 2) * 8 + lane_words % 4  # block 2 c - p, from x_at's 2 c0
    d = per_chunk(d_ptr, rows_in, sd, chunks // 4, chunk_ok, 0.0).to(tl.float32)  # [BN, C]: its super-block's
    total = tl.zeros((BLOCK_M, BLOCK_N, CHUNKS), dtype=tl.float32)
    shift = (2 * parity)[None, :, None]  # the chunk's bits of qh: 0-1 and 4-5, or 2-3 and 6-7
    qh_first, qh_second = qh_first >> shift, qh_second >> shift
    for upper in tl.static_range(2):  # s = p (low nibbles), then s = p + 2 (high nibbles)
        u_first = ((ql_first >> (4 * upper)) & NIBBLES) | (((qh_first >> (4 * upper)) & TWO_BITS) << 4)
        u_second = ((ql_second >> (4 * upper)) & NIBBLES) | (((qh_second >> (4 * upper)) & TWO_BITS) << 4)
        x_first, x_second = _halves(x_at + 16 * upper, x_offsets, word_ok, BLOCK_M, CHUNKS)
        block = 2 * chunks - parity + 2 * upper  # [C]: this block of x, and this pair of scales
        pair = per_chunk(sc_ptr, rows_in, ssc, block, chunk_ok, 0).to(tl.int32)
        sc_first, sc_second = ((pair << 24) >> 24)[None, :, :], (pair >> 8)[None, :, :]
        first = _dot4(u_first, x_first, PTX) - 32 * _sum4(x_first, PTX)[:, None, :]
        second = _dot4(u_second, x_second, PTX) - 32 * _sum4(x_second, PTX)[:, None, :]
        d_x = per_chunk(xd_ptr, m_in, sxd, block, chunk_ok, 0.0)  # [M, C]
        total += (sc_first * first + sc_second * second).to(tl.float32) * (d[None, :, :] * d_x[:, None, :])
    return total


# The rows of x and the partial sums' stride (rows x N) change between steps that quant_matmul.rows_variant calls one
# variant (3 and 4 rows): specialised on them, a step of 3 streams would compile while serving after a warm-up of 4.
@triton.jit(do_not_specialize=["M", "sos"])
def _gemv(xq_ptr, xd_ptr, xs_ptr, out_ptr, result_ptr, counts_ptr, q_ptr, h_ptr, d_ptr, d2_ptr, sc_ptr, mn_ptr,
          M, N, n_chunks, chunks_per_split, half_n, sxq, sxd, sos, som, sres, sq, sh, sd, ssc,
          FAMILY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr,
          PTX: tl.constexpr, SPLIT: tl.constexpr, PAIRED: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """out[split, m, n] = the split's chunks of x_q[m] . W[n] (out [m, n] in x's dtype for one split), and with
    SPLIT their sum into result [m, n] (`sum_splits`); a chunk is 8
    words of the main plane (qs, or Q6_K's ql). Q8_0 (FAMILY 0): d at d_ptr a block. Q4_K (1): d and dmin at d_ptr
    and d2_ptr a super-block, the sub-blocks' 6-bit scales and minimums at sc_ptr and mn_ptr as 16-bit words (a
    chunk's pair). Q6_K (2): qh words at h_ptr, d a super-block, the int8 scales at sc_ptr as 16-bit words (a block
    of x's pair). PAIRED: gate rows over up rows, and out [m, half_n] act(gate) * up, as quant_matmul_triton's
    kernel forms it (one split)."""
    X_BLOCKS: tl.constexpr = 1 if FAMILY == 0 else 2  # blocks of x a chunk
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = program_rows(pid_n, half_n, N, BLOCK_N, PAIRED)
    rows_in = tl.minimum(rows, N - 1)  # rows past N read row N - 1 and are not stored
    m = tl.arange(0, BLOCK_M)
    m_in = tl.minimum(m, M - 1)
    lane_words = tl.arange(0, 4 * CHUNKS)
    chunk_of_word = lane_words // 4
    w_offsets = chunk_of_word * 8 + lane_words % 4  # a chunk is 8 words of weights
    x_offsets = chunk_of_word * (8 * X_BLOCKS) + lane_words % 4
    offs_c = tl.arange(0, CHUNKS)
    w_rows = q_ptr + rows_in[:, None] * sq
    x_rows = xq_ptr + m_in[:, None] * sxq
    x_row_cells = m_in[:, None] * sxd
    acc = tl.zeros((BLOCK_M, BLOCK_N, CHUNKS), dtype=tl.float32)
    first = pid_k * chunks_per_split
    last = tl.minimum(first + chunks_per_split, n_chunks)
    wait_for_inputs(PDL)
    for c0 in range(first, last, CHUNKS):
        word_ok = c0 + chunk_of_word < last
        chunks = c0 + offs_c
        chunk_ok = chunks < last
        w_first, w_second = _halves(w_rows + 8 * c0, w_offsets, word_ok, BLOCK_N, CHUNKS)
        x_at = x_rows + 8 * X_BLOCKS * c0
        if FAMILY == 0:
            x_first, x_second = _halves(x_at, x_offsets, word_ok, BLOCK_M, CHUNKS)
            sums = _dot_block(w_first, w_second, x_first, x_second, PTX).to(tl.float32)
            d_x = tl.load(xd_ptr + x_row_cells + chunks[None, :], mask=chunk_ok[None, :], other=0.0)  # [M, C]
            d = tl.load(d_ptr + rows_in[:, None] * sd + chunks[None, :], mask=chunk_ok[None, :], other=0.0)
            acc += sums * (d.to(tl.float32)[None, :, :] * d_x[:, None, :])
        elif FAMILY == 1:
            acc += _q4_k_chunk(w_first, w_second, x_at, x_offsets, word_ok, xd_ptr, xs_ptr, m_in, sxd, chunks,
                               chunk_ok, d_ptr, d2_ptr, sd, sc_ptr, mn_ptr, ssc, rows_in, BLOCK_M, CHUNKS,
                               PTX)  # fmt: skip
        else:
            acc += _q6_k_chunk(w_first, w_second, x_at, chunk_of_word, lane_words, word_ok, xd_ptr, m_in, sxd,
                               chunks, chunk_ok, h_ptr + rows_in[:, None] * sh + 8 * (c0 // 2), d_ptr, sd, sc_ptr,
                               ssc, rows_in, BLOCK_M, BLOCK_N, CHUNKS, PTX)  # fmt: skip
    out = tl.sum(acc, axis=2)
    store_product(out_ptr, result_ptr, counts_ptr, out, m, M, rows, N, pid_n, pid_k, half_n, sos, som, sres,
                  BLOCK_M, BLOCK_N, PAIRED, SPLIT)  # fmt: skip


def launch_shape(
    ggml_type: GGMLQuantizationType, rows: int, *, block_n: int | None, chunks: int | None, num_warps: int | None
) -> tuple[int, int, int]:
    """(weight rows, chunks, warps) a program, each given one kept. Measured on an H200 (2026-11-29, Llama-3-8B's
    matrices and its output head, bench/quant_matmul.py --dot8 and a scratch sweep of six shapes at one row): 2-4 rows
    of x 8 weight rows, 64 chunks and 2 warps (Q6_K 4 rows: 8 would spill, compiled offline); one row more weight rows
    a program, fewer chunks (Q6_K's head 107.7 us with 16/32/2 against 151.1 with 8/64/2; Q4_K's gate_up 27.7 with
    32/32/4 against 30.0)."""
    if rows == 1:
        shape = (16, 32, 2) if ggml_type == Q.Q6_K else (32, 32, 4)
    else:
        shape = (4, 64, 2) if ggml_type == Q.Q6_K else (8, 64, 2)
    return block_n or shape[0], chunks or shape[1], num_warps or shape[2]


def dot8(
    x: Tensor, planes: Sequence[Tensor], ggml_type: GGMLQuantizationType, *, block_n: int | None = None,
    chunks: int | None = None, num_warps: int | None = None, splits: int | None = None, activate: int = 0,
) -> Tensor:  # fmt: skip
    """x [M, K] (M <= 4) @ W.T through x quantised to 8 bits, W given as its planes (formats.plane_names order);
    [M, N] in x's dtype. With `activate` (a GATE_ constant), W is a gated feed-forward's gate rows over its up rows
    and the product act(gate) * up [M, N / 2], formed as the programs store (one split)."""
    if ggml_type not in FAMILIES:
        raise ValueError(f"dot8 takes {', '.join(t.name for t in FAMILIES)}, not {ggml_type.name}")
    m = x.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"dot8 takes up to {MAX_ROWS} rows of x, not {m}")
    named = dict(zip(plane_names(ggml_type), planes, strict=True))
    family = FAMILIES[ggml_type]
    block_n, chunks, num_warps = launch_shape(ggml_type, m, block_n=block_n, chunks=chunks, num_warps=num_warps)
    words = as_words(named["ql" if ggml_type == Q.Q6_K else "qs"])
    n = words.shape[0]
    high = as_words(named["qh"]) if "qh" in named else words
    d = named["d"]
    d2 = named.get("dmin", d)
    sc = as_words(named["sc"], torch.int16) if "sc" in named else words
    mn = as_words(named["m"], torch.int16) if "m" in named else words
    xq, xd, xs = quantise_rows(x)
    n_chunks = words.shape[1] // 8
    chunks = min(chunks, triton.next_power_of_2(n_chunks))
    programs, chunks_per_split, out = product_output(
        x, n=n, n_chunks=n_chunks, chunks=chunks, block_n=block_n, splits=splits, activate=activate
    )  # fmt: skip
    parts = out.parts
    _gemv[(programs, out.splits)](
        xq, xd, xs, parts, out.result, out.counts, words, high, d, d2, sc, mn, m, n, n_chunks, chunks_per_split, n // 2,
        xq.stride(0), xd.stride(0), out.split_stride, parts.stride(-2), out.result.stride(0),
        words.stride(0), high.stride(0), d.stride(0), sc.stride(0),
        FAMILY=family, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, CHUNKS=chunks, PTX=x.is_cuda,
        SPLIT=out.splits > 1, PAIRED=activate, num_warps=num_warps, **dependent_launch.options(x.device),
    )  # fmt: skip
    return out.result
