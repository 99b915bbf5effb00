"""GGUF blocks as the quantised-matmul kernels read them, in place: the planes of strata.stage_worker.weights.formats
cut into chunks, each chunk's values formed in registers. quant_matmul_triton's fused decode kernel and
quant_gemm_triton's tensor-core kernel share these readers, and the launch helpers around them (where their outputs
go: strata.stage_worker.kernels.product_outputs_triton).

The unit of work is a chunk: 16 bytes (four 32-bit words) of a row's main plane (qs, or ql for Q6_K), with whatever
else the values of those bytes need (their high bits, their sub-block's scale and offset). Every type is read the
same way, so one template serves all; `read_chunk` and `value_pair` hold the types' differences.

- A value is `a u + b`: u an unsigned integer of at most 8 bits, a and b per sub-block in f32. Q8_0's int8 q is
  u - 128 (the sign bits flipped), Q4_0's offset b is -8 d, Q4_K's -dmin m, Q6_K's -32 d sc.
- Two values at once: one mask (and for two of a word's four bytes, one shift) leaves the u of bytes t and t + 2 as
  the mantissas of two f16 with a zero exponent, subnormals worth u 2^-24 that convert to f32 exactly. The
  conversions run on the FMA pipe, beside the products; the integer pipe that masks and shifts is half as fast.

Tiles are [rows, chunks, 4 words]: every row of a program in each lane's registers, the chunks across the lanes and
warps, a chunk's four words in one lane (one 16-byte load). Every tensor of a kernel's loop must have its chunks along
the lanes: where Triton places a tile's dimensions by the contiguity of its addresses and rows and chunks tie, some
versions put the rows on the lanes, and each use then pays a layout conversion through shared memory (`per_chunk`
and the flat word loads avoid it; quant_matmul_triton says what that cost).
"""

from __future__ import annotations

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
def per_chunk(ptr, rows, stride, index, mask, other):
    """ptr[rows, index] as [BN, C] (index and mask [C]), loaded as [C, BN] and transposed: where rows and chunks
    tie in contiguity, Triton lays the first dimension along the lanes, and the chunks must be (as the words are)."""
    return tl.trans(tl.load(ptr + rows[None, :] * stride + index[:, None], mask=mask[:, None], other=other))


@triton.jit
def per_chunk_words(ptr, rows, stride, index, mask):
    """The four words from ptr[rows, index] on, as [BN, C, 4]: `per_chunk` for a word plane."""
    four = tl.arange(0, 4)[None, None, :]
    words = tl.load(ptr + rows[None, :, None] * stride + index[:, None, None] + four, mask=mask[:, None, None], other=0)
    return tl.permute(words, (1, 0, 2))


# What a matrix's x is made of: x itself (GATE_NONE), or act(gate) * up of a gated feed-forward's gate/up output,
# the gate at the x column and the up `gate_offset` columns on (GATE_SILU, GATE_GELU_TANH). The feed-forward's
# activation was a compiled kernel of its own a layer; in the down projection's load it costs no launch.
GATE_NONE: tl.constexpr = tl.constexpr(0)
GATE_SILU: tl.constexpr = tl.constexpr(1)
GATE_GELU_TANH: tl.constexpr = tl.constexpr(2)


@triton.jit
def gated_load(pointers, mask, gate_offset, GATE: tl.constexpr):
    """x at pointers in its dtype; or, with a GATE, act(gate) * up computed in f32 and rounded once to the
    activations' dtype, as the compiled feed-forward computed it before it moved into this load."""
    if GATE == GATE_NONE:
        return tl.load(pointers, mask=mask, other=0.0)
    gate = tl.load(pointers, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(pointers + gate_offset, mask=mask, other=0.0).to(tl.float32)
    return act_times_up(gate, up, GATE).to(pointers.dtype.element_ty)


@triton.jit
def act_times_up(gate, up, GATE: tl.constexpr):
    """act(gate) * up in f32, for GATE_SILU or GATE_GELU_TANH."""
    if GATE == GATE_SILU:
        activated = gate / (1.0 + tl.exp(-gate))
    else:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2 / pi) (g + 0.044715 g^3)
        activated = gate * (1.0 / (1.0 + tl.exp(-2.0 * inner)))  # 0.5 g (1 + tanh(inner))
    return activated * up


@triton.jit
def x_values(pointers, mask, gate_offset, GATE: tl.constexpr):
    """x at pointers [C, BLOCK_M, 8] (see `gated_load`) as f32 [BLOCK_M, C, 8]: chunks first for `per_chunk`'s
    reason."""
    return tl.permute(gated_load(pointers, mask, gate_offset, GATE).to(tl.float32), (1, 0, 2))


# What is done to x before the product (the `NORM` constexpr): nothing; the RMS norm of x times a weight; or the
# norm of h = x + residual, h stored as the block's new stream. A decode step's norms and residual adds were two
# compiled kernels a layer; in the next matrix's load of x they cost no launch. A program reads every column of x once,
# so it sums h^2 beside its products and scales its outputs by 1 / rms at the end: (h g . w) / rms = (h / rms) g . w.
NORM_NONE: tl.constexpr = tl.constexpr(0)
NORM_RMS: tl.constexpr = tl.constexpr(1)
NORM_ADD_RMS: tl.constexpr = tl.constexpr(2)


@triton.jit
def normed_values(pointers, mask, residuals, weights, h_out, store, NORM: tl.constexpr):
    """h * g as f32 [BLOCK_M, C, 8] (see `x_values`) with h = x (+ the residual, rounded to x's dtype as the stream
    is kept, and stored at h_out where `store`), and h^2 summed over the 8 values, [BLOCK_M, C]."""
    h = tl.load(pointers, mask=mask, other=0.0)
    if NORM == NORM_ADD_RMS:
        h = (h.to(tl.float32) + tl.load(residuals, mask=mask, other=0.0).to(tl.float32)).to(h.dtype)
        tl.store(h_out, h, mask=mask & store)
    values = tl.permute(h.to(tl.float32), (1, 0, 2))
    g = tl.permute(tl.load(weights, mask=mask, other=0.0).to(tl.float32), (1, 0, 2))
    return values * g, tl.sum(values * values, axis=2)


@triton.jit
def read_chunk(FAMILY: tl.constexpr, BITS: tl.constexpr, MINIMUMS: tl.constexpr,
           q_ptr, h_ptr, d_ptr, d2_ptr, sc_ptr, mn_ptr, sq, sh, sd, sd2, ssc, smn,
           rows, kc, kmask, flat, flat_mask):  # fmt: skip
    """Everything a tile of chunks needs: rows [BN], chunk indices along the row kc [C] (kmask: inside the row), and
    the same chunks' words as one range, flat [4 C] (flat_mask).

    Returns the main plane's words [BN, C, 4] (uint32), the high-bit words arranged for `value_pair` (the main words
    where a type has none), the scale a and offset b of the low and high nibbles [BN, C] f32, and the column of word
    0, byte 0, low nibble of each chunk [C]."""
    words = chunk_words(FAMILY, q_ptr, sq, rows, kc, flat, flat_mask)
    high, a_lo, b_lo, a_hi, b_hi = chunk_fields(FAMILY, BITS, MINIMUMS, h_ptr, d_ptr, d2_ptr, sc_ptr, mn_ptr, sh, sd,
                                                sd2, ssc, smn, rows, kc, kmask)  # fmt: skip
    if not (FAMILY == 3 or BITS == 5):
        high = words  # `value_pair` reads the main words alone there
    return words, high, a_lo, b_lo, a_hi, b_hi, chunk_base(FAMILY, kc)


@triton.jit
def chunk_words(FAMILY: tl.constexpr, q_ptr, sq, rows, kc, flat, flat_mask):
    """The main plane's words of chunks kc [C] (the same as one range, flat [4 C], flat_mask) of rows [BN]: [BN, C,
    4] uint32, Q8_0's int8 flipped to q + 128."""
    # Loaded as a [BN, 4 C] range and reshaped: the range's contiguity is what makes Triton give each lane a chunk's
    # four words in one 16-byte load, the lanes along the row (as [BN, C, 4], rows and chunks tie, and some Triton
    # versions spread the rows over the lanes, which costs a layout conversion through shared memory at every use).
    words = tl.load(q_ptr + rows[:, None] * sq + flat[None, :], mask=flat_mask[None, :], other=0)
    words = tl.reshape(words, (words.shape[0], kc.shape[0], 4))
    if FAMILY == 0:
        words = words ^ SIGN_BITS
    return words.to(tl.uint32, bitcast=True)  # unsigned from here: right shifts bring in zeros


@triton.jit
def chunk_fields(FAMILY: tl.constexpr, BITS: tl.constexpr, MINIMUMS: tl.constexpr,
                 h_ptr, d_ptr, d2_ptr, sc_ptr, mn_ptr, sh, sd, sd2, ssc, smn, rows, kc, kmask):  # fmt: skip
    """What chunks kc [C] (kmask: inside the row) of rows [BN] need besides their main words: the high-bit words
    [BN, C, 4] uint32 arranged for `value_pair` (Q5 types and Q6_K; 0 for the others), and the scale a and offset b
    of the low and high nibbles [BN, C] f32."""
    i3 = tl.arange(0, 4)[None, None, :]
    k3 = kc[None, :, None]
    high = 0
    if FAMILY == 0:  # Q8_0
        a_lo = per_chunk(d_ptr, rows, sd, kc // 2, kmask, 0.0).to(tl.float32)
        b_lo = -128.0 * a_lo
        a_hi = a_lo
        b_hi = b_lo
    elif FAMILY == 1:  # Q4_0, Q4_1, Q5_0, Q5_1: a block of 32 values a chunk
        a_lo = per_chunk(d_ptr, rows, sd, kc, kmask, 0.0).to(tl.float32)
        b_lo = per_chunk(d2_ptr, rows, sd2, kc, kmask, 0.0).to(tl.float32) if MINIMUMS else -(1 << (BITS - 1)) * a_lo
        if BITS == 5:
            # One word of fifth bits per block (= chunk): bit v for value v. Word i of the chunk holds values 4i + t
            # and 16 + 4i + t, so shifting by 4i leaves `value_pair` a constant shift.
            qh = per_chunk(h_ptr, rows, sh, kc, kmask, 0)
            high = (qh[:, :, None] >> (4 * i3)).to(tl.uint32, bitcast=True)
        a_hi = a_lo
        b_hi = b_lo
    elif FAMILY == 2:  # Q4_K, Q5_K
        # 8 chunks a 256-value block; chunk cc holds half of group cc // 2: values 64 g + 16 (cc % 2) + 4 i + t (low
        # nibbles, sub-block 2 g) and 32 more (high nibbles, sub-block 2 g + 1). The two sub-blocks' scales (and
        # minimums) are adjacent bytes: one 16-bit load each (sc_ptr and mn_ptr point at the planes as int16).
        unit = kc // 8
        group = (kc % 8) // 2
        d = per_chunk(d_ptr, rows, sd, unit, kmask, 0.0).to(tl.float32)
        dmin = per_chunk(d2_ptr, rows, sd2, unit, kmask, 0.0).to(tl.float32)
        scales = per_chunk(sc_ptr, rows, ssc, 4 * unit + group, kmask, 0)
        minimums = per_chunk(mn_ptr, rows, smn, 4 * unit + group, kmask, 0)
        a_lo = d * (scales & 0xFF).to(tl.float32)
        a_hi = d * ((scales >> 8) & 0xFF).to(tl.float32)
        b_lo = -dmin * (minimums & 0xFF).to(tl.float32)
        b_hi = -dmin * ((minimums >> 8) & 0xFF).to(tl.float32)
        if BITS == 5:
            # Value 32 j + l's fifth bit is bit j of qh byte l: the chunk's bytes l = 16 (cc % 2) + 4 i + t are qh
            # word 4 (cc % 2) + i, and j = 2 g + nibble; shifting by 2 g leaves a constant shift per (t, nibble).
            qh = per_chunk_words(h_ptr, rows, sh, 8 * (kc // 8) + 4 * (kc % 2), kmask)
            high = (qh >> (2 * ((k3 % 8) // 2))).to(tl.uint32, bitcast=True)
    else:
        # Q6_K: chunk cc of ql holds values 128 hh + 32 (s1 + 2 nibble) + 16 (cc % 2) + 4 i + t with hh = cc // 4,
        # s1 = (cc // 2) % 2; their top two bits are bits 2 (s1 + 2 nibble) of qh byte 32 hh + 16 (cc % 2) + 4 i + t,
        # and each 16 values have an int8 scale: bytes 2 s1 + cc % 2 and 4 more of the eight at 16 unit + 8 hh, read
        # as one 64-bit word (sc_ptr points at the plane as int64).
        unit = kc // 8
        cc = kc % 8
        d = per_chunk(d_ptr, rows, sd, unit, kmask, 0.0).to(tl.float32)
        eight = per_chunk(sc_ptr, rows, ssc, 2 * unit + cc // 4, kmask, 0)
        shift = (8 * (2 * ((cc // 2) % 2) + cc % 2))[None, :].to(tl.int64)
        a_lo = d * ((eight >> shift) & 0xFF).to(tl.int8).to(tl.float32)
        a_hi = d * ((eight >> (shift + 32)) & 0xFF).to(tl.int8).to(tl.float32)
        b_lo = -32.0 * a_lo
        b_hi = -32.0 * a_hi
        qh = per_chunk_words(h_ptr, rows, sh, 16 * (kc // 8) + 8 * (cc // 4) + 4 * (cc % 2), kmask)
        high = (qh >> (2 * ((k3 // 2) % 2))).to(tl.uint32, bitcast=True)
    return high, a_lo, b_lo, a_hi, b_hi


@triton.jit
def chunk_base(FAMILY: tl.constexpr, kc):
    """The column of word 0, byte 0, low nibble of chunks kc (any shape): where `read_chunk`'s families put them (see
    its comments). A chunk's first 16 values (its bytes' low nibbles) are columns base .. base + 15."""
    if FAMILY == 0:
        return 16 * kc
    if FAMILY == 1:
        return 32 * kc
    if FAMILY == 2:
        return 256 * (kc // 8) + 64 * ((kc % 8) // 2) + 16 * (kc % 2)
    return 256 * (kc // 8) + 128 * ((kc % 8) // 4) + 32 * ((kc // 2) % 2) + 16 * (kc % 2)


@triton.jit
def value_pair(FAMILY: tl.constexpr, BITS: tl.constexpr, words, high, t: tl.constexpr, h: tl.constexpr):
    """u 2^-24 of bytes t and t + 2 (t < 2), nibble h, of each word: two f32 tensors. (A 4-bit type's nibbles are
    masked in place, so its high nibbles come 16 times larger: `unit_of` says by what to multiply.)

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
def unit_of(BITS: tl.constexpr, h: tl.constexpr):
    """What `value_pair`'s values of nibble h are multiplied by to give u."""
    out: tl.constexpr = 1 << 20 if BITS == 4 and h == 1 else 1 << 24
    return out


@triton.jit
def four_columns(v):
    """[A, B, 4] -> its four [A, B] columns (the last dimension lies in each thread's registers: no data moves)."""
    even, odd = tl.split(tl.reshape(v, (v.shape[0], v.shape[1], 2, 2)))
    c0, c2 = tl.split(even)
    c1, c3 = tl.split(odd)
    return c0, c1, c2, c3


@triton.jit
def pair_columns(v):
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
def join4(a, b, c, d):
    """[..., 2, 2] holding a, b, c, d in that order (row-major): a join adds a last dimension, so the outer join
    picks between (a, c) and (b, d)."""
    return tl.join(tl.join(a, c), tl.join(b, d))


@triton.jit
def nibble_values(FAMILY: tl.constexpr, BITS: tl.constexpr, w0, w1, w2, w3, h0, h1, h2, h3, a_lo, b_lo, a_hi, b_hi,
                   h: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr):  # fmt: skip
    """The [BLOCK_N, CHUNKS, 16] values of nibble h of a tile of chunks, in column order (word i, byte t: column
    4 i + t), each a u + b in one FMA (the reference's one rounding: a u is exact). w0-w3 and h0-h3: `four_columns` of
    `read_chunk`'s words and high words; a and b its scales and offsets."""
    if FAMILY >= 2 and h == 1:  # a K-quant's nibbles lie in different sub-blocks
        scale = a_hi[:, :, None]
        offset = b_hi[:, :, None]
    else:
        scale = a_lo[:, :, None]
        offset = b_lo[:, :, None]
    v00, v02 = value_pair(FAMILY, BITS, w0, h0, 0, h)
    v01, v03 = value_pair(FAMILY, BITS, w0, h0, 1, h)
    v10, v12 = value_pair(FAMILY, BITS, w1, h1, 0, h)
    v11, v13 = value_pair(FAMILY, BITS, w1, h1, 1, h)
    v20, v22 = value_pair(FAMILY, BITS, w2, h2, 0, h)
    v21, v23 = value_pair(FAMILY, BITS, w2, h2, 1, h)
    v30, v32 = value_pair(FAMILY, BITS, w3, h3, 0, h)
    v31, v33 = value_pair(FAMILY, BITS, w3, h3, 1, h)
    # Joins append dimensions, the last varying fastest: an outer one over t, inner ones over i.
    values = join4(
        join4(v00, v10, v20, v30), join4(v01, v11, v21, v31), join4(v02, v12, v22, v32),
        join4(v03, v13, v23, v33),
    )  # fmt: skip
    u = tl.reshape(values, (BLOCK_N, CHUNKS, 16)) * unit_of(BITS, h)  # exact
    return tl.fma(scale, u, offset)


def as_words(plane: Tensor, dtype: torch.dtype = torch.int32) -> Tensor:
    """A byte plane as words of `dtype`; one that does not start on a 16-byte boundary (a view into a larger buffer)
    is copied, the kernels' vector loads assuming it."""
    return (plane if plane.data_ptr() % 16 == 0 else plane.clone()).view(dtype)


# Scale planes read as wider words (`read_chunk` says why): K-quants' byte pairs of sub-block scales and minimums,
# Q6_K's eight int8 scales of a half block.
SCALE_WORDS = {Q.Q4_K: torch.int16, Q.Q5_K: torch.int16, Q.Q6_K: torch.int64}


def kernel_planes(planes: Sequence[Tensor], ggml_type: GGMLQuantizationType) -> tuple[list[Tensor], list[int]]:
    """The planes in the kernels' slots (main words, high words, d, d2, sc, mn; unused slots repeat the main words)
    and their row strides."""
    named = dict(zip(plane_names(ggml_type), planes, strict=True))
    for name, plane in named.items():
        if not plane.is_contiguous() or plane.dim() != 2:
            raise ValueError(f"{ggml_type.name} plane {name} must be a contiguous [rows, fields] tensor")
    main = as_words(named[MAIN_PLANE[ggml_type]])
    high = as_words(named["qh"]) if "qh" in named else main
    slots = [main, high, *(named.get(name, main) for name in SCALE_PLANES[ggml_type])]
    if ggml_type in SCALE_WORDS:
        slots[4:] = [as_words(plane, SCALE_WORDS[ggml_type]) if plane is not main else main for plane in slots[4:]]
    return slots, [s.stride(0) for s in slots]


def layout_constexprs(ggml_type: GGMLQuantizationType) -> dict[str, int | bool]:
    layout = LAYOUTS[ggml_type]
    return {"FAMILY": layout.family, "BITS": layout.bits, "MINIMUMS": layout.minimums,
            "HALF_STRIDE": layout.half_stride}  # fmt: skip


def chunk_count(columns: int, ggml_type: GGMLQuantizationType) -> int:
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
