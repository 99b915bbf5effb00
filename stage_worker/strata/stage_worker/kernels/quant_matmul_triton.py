"""GGUF-quantised weights times activations in Triton, reading the planes of strata.stage_worker.weights.formats in
place: a fused dequantise-and-dot for decode (a few rows of x), and a dequantise into a dense tensor for prefill.

Why a kernel of our own: a decode step is the weights' bytes over memory bandwidth, and a 4-bit weight read as bf16
is 3.5 times the bytes. The fused kernel reads each quantised byte once, as llama.cpp's mul_mat_vec_q does.

The unit of work is a chunk: 16 bytes (four 32-bit words) of a row's main plane (qs, or ql for Q6_K), with whatever
else the values of those bytes need (their high bits, their sub-block's scale and offset). Every type is read the
same way, so one template serves all; `_chunk` and `_pair` hold the types' differences.

- A value is `a u + b`: u an unsigned integer of at most 8 bits, a and b per sub-block in f32. Q8_0's int8 q is
  u - 128 (the sign bits flipped), Q4_0's offset b is -8 d, Q4_K's -dmin m, Q6_K's -32 d sc.
- Two values at once: one mask (and for two of a word's four bytes, one shift) leaves the u of bytes t and t + 2 as
  the mantissas of two f16 with a zero exponent, subnormals worth u 2^-24 that convert to f32 exactly. The
  conversions run on the FMA pipe, beside the products; the integer pipe that masks and shifts is half as fast.
- Per sub-block, sum (a u + b) x = a 2^24 sum((u 2^-24) x) + b sum(x): the decode kernel multiplies by x (one FMA a
  value) and applies the scales once per chunk. Each product of a bf16 or f16 x is exact in f32.

Tiles are [rows, chunks, 4 words]: every row of a program in each lane's registers, the chunks across the lanes and
warps, a chunk's four words in one lane (one 16-byte load). x is loaded as [rows of x, chunks, 8]: the same lanes,
each reading eight consecutive values of x in one load, used by every row of the program. Every tensor of the loop
must have its chunks along the lanes: where Triton places a tile's dimensions by the contiguity of its addresses and
rows and chunks tie, some versions put the rows on the lanes, and each use then pays a layout conversion through
shared memory. Measured with ncu on an H100 (Triton 3.6), that traffic, not the weights' bytes, bounded the kernel
(L1 85-92% busy, DRAM 29-40%); `_per_chunk` and the flat word loads remove it (Q4_K at one row: 29% -> 71% of a
measured read). Scale planes are read as wider words (`SCALE_WORDS`) to load each chunk's scales once.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType
from strata.stage_worker.weights.formats import FORMATS, plane_names
from torch import Tensor

Q = GGMLQuantizationType
SIGN_BITS: tl.constexpr = tl.constexpr(-0x7F7F7F80)  # 0x80808080 as int32: flips each int8 of a word to q + 128


@dataclass(frozen=True)
class Layout:
    """How a type's chunk maps to values: the kernels' constexprs."""

    family: int  # 0: Q8_0; 1: Q4_0, Q4_1, Q5_0, Q5_1 (a block a chunk); 2: Q4_K, Q5_K; 3: Q6_K
    bits: int  # of u
    minimums: bool  # a plane of per-block offsets (Q4_1 and Q5_1's m)
    half_stride: int  # columns between a byte's low and high nibble (0: a byte holds one value)

    @property
    def values_per_chunk(self) -> int:
        return 16 if self.half_stride == 0 else 32


LAYOUTS: dict[GGMLQuantizationType, Layout] = {
    Q.Q8_0: Layout(0, 8, False, 0),
    Q.Q4_0: Layout(1, 4, False, 16),
    Q.Q4_1: Layout(1, 4, True, 16),
    Q.Q5_0: Layout(1, 5, False, 16),
    Q.Q5_1: Layout(1, 5, True, 16),
    Q.Q4_K: Layout(2, 4, False, 32),
    Q.Q5_K: Layout(2, 5, False, 32),
    Q.Q6_K: Layout(3, 6, False, 64),
}
MAIN_PLANE = {t: "ql" if t == Q.Q6_K else "qs" for t in LAYOUTS}
# The kernels' scale slots, by plane name: d, a second f16 field (dmin, or Q4_1/Q5_1's m), sub-scales, sub-minimums.
SCALE_PLANES = {t: ("d", "m" if t in (Q.Q4_1, Q.Q5_1) else "dmin", "sc", "m" if t in (Q.Q4_K, Q.Q5_K) else "-")
                for t in LAYOUTS}  # fmt: skip


@triton.jit
def _per_chunk(ptr, rows, stride, index, mask, other):
    """ptr[rows, index] as [BN, C] (index and mask [C]), loaded as [C, BN] and transposed: where rows and chunks
    tie in contiguity, Triton lays the first dimension along the lanes, and the chunks must be (as the words are)."""
    return tl.trans(tl.load(ptr + rows[None, :] * stride + index[:, None], mask=mask[:, None], other=other))


@triton.jit
def _per_chunk_words(ptr, rows, stride, index, mask):
    """The four words from ptr[rows, index] on, as [BN, C, 4]: `_per_chunk` for a word plane."""
    four = tl.arange(0, 4)[None, None, :]
    words = tl.load(ptr + rows[None, :, None] * stride + index[:, None, None] + four, mask=mask[:, None, None], other=0)
    return tl.permute(words, (1, 0, 2))


@triton.jit
def _x_values(pointers, mask):
    """x at pointers [C, BLOCK_M, 8] as f32 [BLOCK_M, C, 8]: chunks first for `_per_chunk`'s reason."""
    return tl.permute(tl.load(pointers, mask=mask, other=0.0).to(tl.float32), (1, 0, 2))


@triton.jit
def _chunk(FAMILY: tl.constexpr, BITS: tl.constexpr, MINIMUMS: tl.constexpr,
           q_ptr, h_ptr, d_ptr, d2_ptr, sc_ptr, mn_ptr, sq, sh, sd, sd2, ssc, smn,
           rows, kc, kmask, flat, flat_mask):  # fmt: skip
    """Everything a tile of chunks needs: rows [BN], chunk indices along the row kc [C] (kmask: inside the row), and
    the same chunks' words as one range, flat [4 C] (flat_mask).

    Returns the main plane's words [BN, C, 4] (uint32), the high-bit words arranged for `_pair` (the main words where
    a type has none), the scale a and offset b of the low and high nibbles [BN, C] f32, and the column of word 0,
    byte 0, low nibble of each chunk [C]."""
    i3 = tl.arange(0, 4)[None, None, :]
    r2 = rows[:, None]
    k3 = kc[None, :, None]
    # Loaded as a [BN, 4 C] range and reshaped: the range's contiguity is what makes Triton give each lane a chunk's
    # four words in one 16-byte load, the lanes along the row (as [BN, C, 4], rows and chunks tie, and some Triton
    # versions spread the rows over the lanes, which costs a layout conversion through shared memory at every use).
    words = tl.load(q_ptr + r2 * sq + flat[None, :], mask=flat_mask[None, :], other=0)
    words = tl.reshape(words, (words.shape[0], kc.shape[0], 4))
    high = words
    if FAMILY == 0:  # Q8_0
        words = words ^ SIGN_BITS
        a_lo = _per_chunk(d_ptr, rows, sd, kc // 2, kmask, 0.0).to(tl.float32)
        b_lo = -128.0 * a_lo
        a_hi = a_lo
        b_hi = b_lo
        base = 16 * kc
    elif FAMILY == 1:  # Q4_0, Q4_1, Q5_0, Q5_1: a block of 32 values a chunk
        a_lo = _per_chunk(d_ptr, rows, sd, kc, kmask, 0.0).to(tl.float32)
        b_lo = _per_chunk(d2_ptr, rows, sd2, kc, kmask, 0.0).to(tl.float32) if MINIMUMS else -(1 << (BITS - 1)) * a_lo
        if BITS == 5:
            # One word of fifth bits per block (= chunk): bit v for value v. Word i of the chunk holds values 4i + t
            # and 16 + 4i + t, so shifting by 4i leaves `_pair` a constant shift.
            qh = _per_chunk(h_ptr, rows, sh, kc, kmask, 0)
            high = qh[:, :, None] >> (4 * i3)
        a_hi = a_lo
        b_hi = b_lo
        base = 32 * kc
    elif FAMILY == 2:  # Q4_K, Q5_K
        # 8 chunks a 256-value block; chunk cc holds half of group cc // 2: values 64 g + 16 (cc % 2) + 4 i + t (low
        # nibbles, sub-block 2 g) and 32 more (high nibbles, sub-block 2 g + 1). The two sub-blocks' scales (and
        # minimums) are adjacent bytes: one 16-bit load each (sc_ptr and mn_ptr point at the planes as int16).
        unit = kc // 8
        group = (kc % 8) // 2
        d = _per_chunk(d_ptr, rows, sd, unit, kmask, 0.0).to(tl.float32)
        dmin = _per_chunk(d2_ptr, rows, sd2, unit, kmask, 0.0).to(tl.float32)
        scales = _per_chunk(sc_ptr, rows, ssc, 4 * unit + group, kmask, 0)
        minimums = _per_chunk(mn_ptr, rows, smn, 4 * unit + group, kmask, 0)
        a_lo = d * (scales & 0xFF).to(tl.float32)
        a_hi = d * ((scales >> 8) & 0xFF).to(tl.float32)
        b_lo = -dmin * (minimums & 0xFF).to(tl.float32)
        b_hi = -dmin * ((minimums >> 8) & 0xFF).to(tl.float32)
        if BITS == 5:
            # Value 32 j + l's fifth bit is bit j of qh byte l: the chunk's bytes l = 16 (cc % 2) + 4 i + t are qh
            # word 4 (cc % 2) + i, and j = 2 g + nibble; shifting by 2 g leaves a constant shift per (t, nibble).
            qh = _per_chunk_words(h_ptr, rows, sh, 8 * (kc // 8) + 4 * (kc % 2), kmask)
            high = qh >> (2 * ((k3 % 8) // 2))
        base = 256 * (kc // 8) + 64 * ((kc % 8) // 2) + 16 * (kc % 2)
    else:
        # Q6_K: chunk cc of ql holds values 128 hh + 32 (s1 + 2 nibble) + 16 (cc % 2) + 4 i + t with hh = cc // 4,
        # s1 = (cc // 2) % 2; their top two bits are bits 2 (s1 + 2 nibble) of qh byte 32 hh + 16 (cc % 2) + 4 i + t,
        # and each 16 values have an int8 scale: bytes 2 s1 + cc % 2 and 4 more of the eight at 16 unit + 8 hh, read
        # as one 64-bit word (sc_ptr points at the plane as int64).
        unit = kc // 8
        cc = kc % 8
        d = _per_chunk(d_ptr, rows, sd, unit, kmask, 0.0).to(tl.float32)
        eight = _per_chunk(sc_ptr, rows, ssc, 2 * unit + cc // 4, kmask, 0)
        shift = (8 * (2 * ((cc // 2) % 2) + cc % 2))[None, :].to(tl.int64)
        a_lo = d * ((eight >> shift) & 0xFF).to(tl.int8).to(tl.float32)
        a_hi = d * ((eight >> (shift + 32)) & 0xFF).to(tl.int8).to(tl.float32)
        b_lo = -32.0 * a_lo
        b_hi = -32.0 * a_hi
        qh = _per_chunk_words(h_ptr, rows, sh, 16 * (kc // 8) + 8 * (cc // 4) + 4 * (cc % 2), kmask)
        high = qh >> (2 * ((k3 // 2) % 2))
        base = 256 * (kc // 8) + 128 * ((kc % 8) // 4) + 32 * ((kc // 2) % 2) + 16 * (kc % 2)
    # Unsigned from here: right shifts bring in zeros.
    return words.to(tl.uint32, bitcast=True), high.to(tl.uint32, bitcast=True), a_lo, b_lo, a_hi, b_hi, base


@triton.jit
def _pair(FAMILY: tl.constexpr, BITS: tl.constexpr, words, high, t: tl.constexpr, h: tl.constexpr):
    """u 2^-24 of bytes t and t + 2 (t < 2), nibble h, of each word: two f32 tensors. (A 4-bit type's nibbles are
    masked in place, so its high nibbles come 16 times larger: `_unit` says by what to multiply.)

    Q5 and Q6_K first gather a nibble's high bits beside it, for a word's four bytes at once (the compiler shares
    that across t): byte t of `source` is then u."""
    NIBBLE_WORDS: tl.constexpr = BITS == 4
    if NIBBLE_WORDS or FAMILY == 0:
        source = words
    else:
        # Each byte's low four bits from the nibble, its high ones from `top` (bits above u are masked below).
        low = words >> (4 * h)
        if FAMILY == 1:
            # Bits 16 h .. 16 h + 3 (one per byte t) to bit 4 of byte t: the multiply places copies of the four bits
            # at strides of 7 with no carries, the copy of bit t at 8 t + 4 and no other at bit 4 of a byte.
            top = ((high >> (16 * h)) & 0xF) * 0x2040810
        elif FAMILY == 2:
            top = high << (4 - h)
        else:
            top = high << (4 - 4 * h)
        source = (low & 0x0F0F0F0F) | (top & 0xF0F0F0F0)
    field: tl.constexpr = 0x000F000F << (4 * h) if NIBBLE_WORDS else ((1 << BITS) - 1) * 0x00010001
    if t == 1:
        source = source >> 8
    bits = source & field
    first = bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    second = (bits >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return first, second


@triton.jit
def _unit(BITS: tl.constexpr, h: tl.constexpr):
    """What `_pair`'s values of nibble h are multiplied by to give u."""
    out: tl.constexpr = 1 << 20 if BITS == 4 and h == 1 else 1 << 24
    return out


@triton.jit
def _columns(v):
    """[A, B, 4] -> its four [A, B] columns (the last dimension lies in each thread's registers: no data moves)."""
    even, odd = tl.split(tl.reshape(v, (v.shape[0], v.shape[1], 2, 2)))
    c0, c2 = tl.split(even)
    c1, c3 = tl.split(odd)
    return c0, c1, c2, c3


@triton.jit
def _word_columns(v):
    """[A, B, 8] (two words' four values each) -> ((its four [A, B] columns of word 0), (those of word 1))."""
    five = tl.reshape(v, (v.shape[0], v.shape[1], 2, 2, 2))  # [.., word, t // 2, t % 2]
    even, odd = tl.split(five)
    t0, t2 = tl.split(even)
    t1, t3 = tl.split(odd)
    t0_0, t0_1 = tl.split(t0)
    t1_0, t1_1 = tl.split(t1)
    t2_0, t2_1 = tl.split(t2)
    t3_0, t3_1 = tl.split(t3)
    return (t0_0, t1_0, t2_0, t3_0), (t0_1, t1_1, t2_1, t3_1)


@triton.jit
def _join4(a, b, c, d):
    """[..., 2, 2] holding a, b, c, d in that order (row-major): a join adds a last dimension, so the outer join
    picks between (a, c) and (b, d)."""
    return tl.join(tl.join(a, c), tl.join(b, d))


@triton.jit
def _gemv(
    x_ptr, out_ptr, q_ptr, h_ptr, d_ptr, d2_ptr, sc_ptr, mn_ptr,
    M, N, n_chunks, chunks_per_split,
    sxm, sos, som, sq, sh, sd, sd2, ssc, smn,
    FAMILY: tl.constexpr, BITS: tl.constexpr, MINIMUMS: tl.constexpr, HALF_STRIDE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """out[split, m, n] = sum over the split's chunks of x[m] . W[n], for the M (<= BLOCK_M) rows of x at once.

    One row of x: the sums of (u 2^-24) x and of x per sub-block half, scaled once a chunk. More rows: each value
    a u + b is formed once (one FMA) and multiplied by every row's x."""
    NIBBLES: tl.constexpr = 1 if HALF_STRIDE == 0 else 2
    SPLIT_HALVES: tl.constexpr = FAMILY >= 2  # a K-quant's nibbles lie in different sub-blocks
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_in = tl.minimum(rows, N - 1)  # rows past N read row N - 1 and are not stored: no masked weight loads
    m = tl.arange(0, BLOCK_M)
    x_rows = x_ptr + tl.minimum(m, M - 1)[None, :, None] * sxm  # [1, BLOCK_M, 1]: see `_x_values`
    offs_c = tl.arange(0, CHUNKS)
    offs_w = tl.arange(0, 4 * CHUNKS)
    eight = tl.arange(0, 8)[None, None, :]
    if BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N, CHUNKS), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, CHUNKS), dtype=tl.float32)
    first = pid_k * chunks_per_split
    last = tl.minimum(first + chunks_per_split, n_chunks)
    for k0 in range(first, last, CHUNKS):
        kc = k0 + offs_c
        kmask = (kc < last) | EVEN_K
        flat = 4 * k0 + offs_w
        words, high, a_lo, b_lo, a_hi, b_hi, base = _chunk(
            FAMILY, BITS, MINIMUMS, q_ptr, h_ptr, d_ptr, d2_ptr, sc_ptr, mn_ptr, sq, sh, sd, sd2, ssc, smn,
            rows_in, kc, kmask, flat, (flat < 4 * last) | EVEN_K,
        )  # fmt: skip
        word_columns = _columns(words)
        high_columns = _columns(high)
        xmask = kmask[:, None, None] & (eight < 8)
        if BLOCK_M == 1:
            f_lo = tl.zeros((BLOCK_N, CHUNKS), dtype=tl.float32)
            f_hi = tl.zeros((BLOCK_N, CHUNKS), dtype=tl.float32)
            x_lo = tl.zeros((1, CHUNKS), dtype=tl.float32)
            x_hi = tl.zeros((1, CHUNKS), dtype=tl.float32)
        for h in tl.static_range(NIBBLES):
            # A nibble's 16 values of x are consecutive columns: two 16-byte loads, words 0-1 and 2-3.
            column = base[:, None, None] + HALF_STRIDE * h + eight
            first_words = _word_columns(_x_values(x_rows + column, xmask))
            last_words = _word_columns(_x_values(x_rows + column + 8, xmask))
            for i in tl.static_range(4):
                x_columns = first_words[i] if i < 2 else last_words[i - 2]
                if SPLIT_HALVES and h == 1:
                    scale = a_hi * _unit(BITS, h)
                    offset = b_hi
                else:
                    scale = a_lo * _unit(BITS, h)
                    offset = b_lo
                for t in tl.static_range(2):
                    f_a, f_b = _pair(FAMILY, BITS, word_columns[i], high_columns[i], t, h)
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
            acc += a_lo * _unit(BITS, 0) * f_lo + b_lo * x_lo
            if NIBBLES == 2:
                acc += a_hi * _unit(BITS, 1) * f_hi + b_hi * x_hi
    out = tl.sum(acc, axis=1)[None, :] if BLOCK_M == 1 else tl.sum(acc, axis=2)
    mask = (m < M)[:, None] & (rows < N)[None, :]
    tl.store(out_ptr + pid_k * sos + m[:, None] * som + rows[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _nibble_values(FAMILY: tl.constexpr, BITS: tl.constexpr, w0, w1, w2, w3, h0, h1, h2, h3, a_lo, b_lo, a_hi, b_hi,
                   h: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr):  # fmt: skip
    """The [BLOCK_N, CHUNKS, 16] values of nibble h of a tile of chunks, in column order (word i, byte t: column
    4 i + t), each a u + b in one FMA (the reference's one rounding: a u is exact). w0-w3 and h0-h3: `_columns` of
    `_chunk`'s words and high words; a and b its scales and offsets."""
    if FAMILY >= 2 and h == 1:  # a K-quant's nibbles lie in different sub-blocks
        scale = a_hi[:, :, None]
        offset = b_hi[:, :, None]
    else:
        scale = a_lo[:, :, None]
        offset = b_lo[:, :, None]
    v00, v02 = _pair(FAMILY, BITS, w0, h0, 0, h)
    v01, v03 = _pair(FAMILY, BITS, w0, h0, 1, h)
    v10, v12 = _pair(FAMILY, BITS, w1, h1, 0, h)
    v11, v13 = _pair(FAMILY, BITS, w1, h1, 1, h)
    v20, v22 = _pair(FAMILY, BITS, w2, h2, 0, h)
    v21, v23 = _pair(FAMILY, BITS, w2, h2, 1, h)
    v30, v32 = _pair(FAMILY, BITS, w3, h3, 0, h)
    v31, v33 = _pair(FAMILY, BITS, w3, h3, 1, h)
    # Joins append dimensions, the last varying fastest: an outer one over t, inner ones over i.
    values = _join4(
        _join4(v00, v10, v20, v30), _join4(v01, v11, v21, v31), _join4(v02, v12, v22, v32),
        _join4(v03, v13, v23, v33),
    )  # fmt: skip
    u = tl.reshape(values, (BLOCK_N, CHUNKS, 16)) * _unit(BITS, h)  # exact
    return tl.fma(scale, u, offset)


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
    words, high, a_lo, b_lo, a_hi, b_hi, base = _chunk(
        FAMILY, BITS, MINIMUMS, q_ptr, h_ptr, d_ptr, d2_ptr, sc_ptr, mn_ptr, sq, sh, sd, sd2, ssc, smn,
        rows_in, kc, kmask, flat, flat < 4 * n_chunks,
    )  # fmt: skip
    w0, w1, w2, w3 = _columns(words)
    h0, h1, h2, h3 = _columns(high)
    sixteen = tl.arange(0, 16)[None, None, :]
    mask = (rows < N)[:, None, None] & kmask[None, :, None] & (sixteen < 16)
    for h in tl.static_range(NIBBLES):
        # Each lane stores a chunk's 16 values of nibble h, consecutive columns: 32 contiguous bytes (whole sectors;
        # four values a store left L2 merging quarters).
        value = _nibble_values(FAMILY, BITS, w0, w1, w2, w3, h0, h1, h2, h3, a_lo, b_lo, a_hi, b_hi, h, BLOCK_N, CHUNKS)
        column = base[None, :, None] + HALF_STRIDE * h + sixteen
        tl.store(out_ptr + rows[:, None, None] * so + column, value.to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


@dataclass(frozen=True)
class Config:
    """A launch shape; bench/quant_matmul.py --sweep measures the alternatives. None: `default_config`'s."""

    block_n: int | None = None  # weight rows a program (each lane holds all of them)
    chunks: int | None = None  # chunks a step along K: 32 lanes x warps (x chunks a lane)
    num_warps: int | None = None
    splits: int | None = None  # programs along K; None: enough for WAVES programs a multiprocessor


MAX_ROWS = 16  # rows of x the fused kernel takes (its registers hold them all)
WAVES = 4


def default_config(ggml_type: GGMLQuantizationType, rows: int) -> Config:
    """Measured (bench/quant_matmul.py --sweep, Llama-3-8B's matrices, an H100 and an H200 agreeing). One row:
    4-bit types did best with 8 rows a lane and 2 warps a program, Q8_0 with 2 chunks a lane, Q5 and Q6_K with 4
    rows and a chunk a lane. Several rows of x: 8 weight rows a program, as many as the x rows' registers permit."""
    if rows > 1:
        return Config(block_n=8, chunks=128, num_warps=4)
    if ggml_type == Q.Q8_0:
        return Config(block_n=4, chunks=256, num_warps=4)
    if LAYOUTS[ggml_type].bits == 4:
        return Config(block_n=8, chunks=64, num_warps=2)
    return Config(block_n=4, chunks=128, num_warps=4)


def _words(plane: Tensor, dtype: torch.dtype = torch.int32) -> Tensor:
    """A byte plane as words of `dtype`; one that does not start on a 16-byte boundary (a view into a larger buffer)
    is copied, the kernels' vector loads assuming it."""
    return (plane if plane.data_ptr() % 16 == 0 else plane.clone()).view(dtype)


# Scale planes read as wider words (`_chunk` says why): K-quants' byte pairs of sub-block scales and minimums, Q6_K's
# eight int8 scales of a half block.
SCALE_WORDS = {Q.Q4_K: torch.int16, Q.Q5_K: torch.int16, Q.Q6_K: torch.int64}


def _planes(planes: Sequence[Tensor], ggml_type: GGMLQuantizationType) -> tuple[list[Tensor], list[int]]:
    """The planes in the kernels' slots (main words, high words, d, d2, sc, mn; unused slots repeat the main words)
    and their row strides."""
    named = dict(zip(plane_names(ggml_type), planes, strict=True))
    for name, plane in named.items():
        if not plane.is_contiguous() or plane.dim() != 2:
            raise ValueError(f"{ggml_type.name} plane {name} must be a contiguous [rows, fields] tensor")
    main = _words(named[MAIN_PLANE[ggml_type]])
    high = _words(named["qh"]) if "qh" in named else main
    slots = [main, high, *(named.get(name, main) for name in SCALE_PLANES[ggml_type])]
    if ggml_type in SCALE_WORDS:
        slots[4:] = [_words(plane, SCALE_WORDS[ggml_type]) if plane is not main else main for plane in slots[4:]]
    return slots, [s.stride(0) for s in slots]


def _constexprs(ggml_type: GGMLQuantizationType) -> dict[str, int | bool]:
    layout = LAYOUTS[ggml_type]
    return {"FAMILY": layout.family, "BITS": layout.bits, "MINIMUMS": layout.minimums,
            "HALF_STRIDE": layout.half_stride}  # fmt: skip


def _chunks(columns: int, ggml_type: GGMLQuantizationType) -> int:
    if columns % FORMATS[ggml_type].block_elements:
        raise ValueError(f"{ggml_type.name}: {columns} columns are not whole blocks")
    return columns // LAYOUTS[ggml_type].values_per_chunk


def checked_rows(x: Tensor, *, columns: int, most: int, kernel: str) -> Tensor:
    """x [M, K] as a kernel takes it (rows dense), after refusing a K that is not the weight's or M past `most`."""
    m_rows, k = x.shape
    if k != columns:
        raise ValueError(f"x has {k} columns, the weight {columns}")
    if m_rows > most:
        raise ValueError(f"the {kernel} kernel takes at most {most} rows of x, not {m_rows}")
    return x if x.stride(1) == 1 else x.contiguous()


def split_k(x: Tensor, *, n: int, n_chunks: int, chunks: int, programs: int, splits: int | None) -> tuple[int, Tensor]:
    """(chunks per split, out): splits along K enough for WAVES programs a multiprocessor (or `splits`), out
    [M, N] in x's dtype for one, else [splits, M, N] f32 partial sums that the caller adds."""
    steps = triton.cdiv(n_chunks, chunks)
    wanted = splits or max(1, min(steps, WAVES * _multiprocessors(x.device) // programs))
    chunks_per_split = triton.cdiv(steps, wanted) * chunks
    splits = triton.cdiv(n_chunks, chunks_per_split)
    if splits == 1:
        return chunks_per_split, torch.empty((x.shape[0], n), device=x.device, dtype=x.dtype)
    return chunks_per_split, torch.empty((splits, x.shape[0], n), device=x.device, dtype=torch.float32)


def quant_matmul(
    x: Tensor, planes: Sequence[Tensor], ggml_type: GGMLQuantizationType, *, columns: int, config: Config | None = None
) -> Tensor:
    """x [M, K] (M <= 16) @ W.T -> [M, N] in x's dtype, W given as its planes (formats.plane_names order)."""
    x = checked_rows(x, columns=columns, most=MAX_ROWS, kernel="fused")
    m_rows, n = x.shape[0], planes[0].shape[0]
    if m_rows == 0:
        return x.new_empty((0, n))
    n_chunks = _chunks(columns, ggml_type)
    default = default_config(ggml_type, m_rows)
    config = config or default
    block_n = config.block_n or default.block_n or 4
    warps = config.num_warps or default.num_warps or 4
    chunks = min(config.chunks or default.chunks or 128, triton.next_power_of_2(n_chunks))
    programs = triton.cdiv(n, block_n)
    chunks_per_split, out = split_k(x, n=n, n_chunks=n_chunks, chunks=chunks, programs=programs, splits=config.splits)
    splits = 1 if out.dim() == 2 else out.shape[0]
    slots, strides = _planes(planes, ggml_type)
    _gemv[(programs, splits)](
        x, out, *slots, m_rows, n, n_chunks, chunks_per_split,
        x.stride(0), out.stride(0) if splits > 1 else 0, out.stride(-2), *strides,
        **_constexprs(ggml_type), BLOCK_M=triton.next_power_of_2(m_rows), BLOCK_N=block_n, CHUNKS=chunks,
        EVEN_K=n_chunks % chunks_per_split == 0 and chunks_per_split % chunks == 0, num_warps=warps, num_stages=1,
    )  # fmt: skip
    return out if splits == 1 else out.sum(dim=0).to(x.dtype)


def dequantize(
    planes: Sequence[Tensor], ggml_type: GGMLQuantizationType, *, columns: int, dtype: torch.dtype
) -> Tensor:
    """The weight [N, K] in `dtype` (each value computed as the f32 reference computes it, then rounded)."""
    n = planes[0].shape[0]
    n_chunks = _chunks(columns, ggml_type)
    out = torch.empty((n, columns), device=planes[0].device, dtype=dtype)
    block_n, chunks = 4, min(128, triton.next_power_of_2(n_chunks))
    slots, strides = _planes(planes, ggml_type)
    grid = (triton.cdiv(n, block_n), triton.cdiv(n_chunks, chunks))
    _dequantise[grid](
        out, *slots, n, n_chunks, out.stride(0), *strides,
        **_constexprs(ggml_type), BLOCK_N=block_n, CHUNKS=chunks, num_warps=4,
    )  # fmt: skip
    return out
