"""Attention over the KV pool in place, in Triton: each sequence's cells are read through its row of the pool's table,
in their stored type (q8_0 dequantised in registers with its f16 scales), once per GQA group, over exactly the
positions the sequence holds.

Why a kernel of our own: a decode step at depth is the KV's bytes over memory bandwidth, and every library candidate
either reads a gathered bf16 copy (SDPA, flash-attn's bf16 pools) or does not read ggml's q8_0 block layout. The
design follows flash-decoding: a sequence's positions are split across programs (so one stream at 128K fills the
GPU), each program keeps an online softmax over its split, and a second kernel merges the splits by their
log-sum-exp. One program takes all query heads of one KV head (the GQA group) and a tile of a sequence's query
positions, packed into the M dimension of the dot products, so a decode step (one position), a speculative step (a
few) and a prefill chunk after a cached prefix (many) run the same code.

Under a bf16 or f16 q, q8_0 and f16 K/V go into the dot products as f16 (the int8 values converted with integer
operations, `_int8_to_f16`): exact for the stored values, and it keeps the step off the conversion unit, which runs at
a quarter of the ALU rate. A K/V value past f16's range (65,504) would be inf there, as in llama.cpp's f16 cache.

The table maps a sequence's page to a pool cell: `cell = table[slot, pos // PAGE] * PAGE + pos % PAGE`. Today's pool
holds one position per cell (PAGE = 1); a paged pool passes its block size.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from strata.stage_worker.kernels import dependent_launch
from strata.stage_worker.kernels.dependent_launch import wait_for_inputs
from torch import Tensor

Q8_BLOCK = 32
NO_WINDOW = 1 << 30  # the window of layers without one: longer than any sequence, so it masks nothing


@triton.jit
def _int8_to_f16(values):
    """int8 -> f16 exactly without the conversion unit (a quarter of the ALU rate, and at depth the step's limit):
    the byte with its sign bit flipped is the mantissa of 1024 + (v + 128) in f16, bits 0x6400 | (v ^ 0x80)."""
    bits = (values.to(tl.uint8, bitcast=True).to(tl.uint16) ^ 0x6480).to(tl.uint16)
    return bits.to(tl.float16, bitcast=True) - 1152.0


@triton.jit
def _int8x4_to_f16(values):
    """`_int8_to_f16` four bytes of a register at a time, in PTX: one XOR flips the four sign bits, two byte permutes
    put 0x64 above each byte (two f16 a register), two f16x2 subtractions take the 1152 off. Triton's own lowering of
    `_int8_to_f16` extracts and repacks every byte (two permutes for two values). GPU only: no interpreter runs PTX."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 flipped, offset;
        xor.b32 flipped, $2, 0x80808080;
        mov.b32 offset, 0x64806480;
        prmt.b32 $0, flipped, 0x64646464, 0x4140;
        prmt.b32 $1, flipped, 0x64646464, 0x4342;
        sub.f16x2 $0, $0, offset;
        sub.f16x2 $1, $1, offset;
        }""",
        constraints="=r,=r,r",
        args=[values],
        dtype=tl.float16,
        is_pure=True,
        pack=4,
    )


@triton.jit
def _dequantise(values, scales_ptr, cell, stride_sc, first_column, pos_ok, d_ok, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCKED: tl.constexpr, F16: tl.constexpr, PACKED: tl.constexpr):  # fmt: skip
    """q8_0 int8 values [N, D] of one KV head times their f16 scales (one per 32 values of a cell's row), in f16
    (F16: for f16 dot products) or f32.

    When the head starts on a block boundary (BLOCKED), each row's D / 32 scales are loaded once and broadcast over
    their blocks; otherwise every value loads its own scale (the same bytes, many more load instructions), and only
    for the head's columns: a padded column past the last head would read past the row, and 0 times a stray inf or
    NaN there is NaN in every score."""
    if PACKED:
        numbers = _int8x4_to_f16(values)
    elif F16:
        numbers = _int8_to_f16(values)
    else:
        numbers = values.to(tl.float32)
    if BLOCKED:
        offs_b = tl.arange(0, BLOCK_D // 32)
        scale = tl.load(scales_ptr + cell[:, None] * stride_sc + first_column // 32 + offs_b[None, :],
                        mask=pos_ok[:, None], other=0.0).to(numbers.dtype)  # fmt: skip
        blocks = tl.reshape(numbers, (BLOCK_N, BLOCK_D // 32, 32))
        return tl.reshape(blocks * scale[:, :, None], (BLOCK_N, BLOCK_D))
    offs_d = tl.arange(0, BLOCK_D)
    scale = tl.load(scales_ptr + cell[:, None] * stride_sc + (first_column + offs_d[None, :]) // 32,
                    mask=pos_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
    return numbers * scale.to(numbers.dtype)


@triton.jit
def _q_block_int8(q_ptr, q_rows, row_ok, sm_scale, first: tl.constexpr):
    """Query values [first, first + 32) of each row, times sm_scale, rounded to int8 on a scale of their own (the
    largest magnitude over 127), with that scale: llama.cpp's q8_1 rounding of Q against a quantised K."""
    offs_j = tl.arange(0, 32)
    x = tl.load(q_ptr + q_rows[:, None] + first + offs_j[None, :], mask=row_ok[:, None], other=0.0)
    x = x.to(tl.float32) * sm_scale
    scale = tl.max(tl.abs(x), axis=1) / 127.0
    x = x / tl.where(scale > 0.0, scale, 1.0)[:, None]
    return tl.where(x >= 0.0, x + 0.5, x - 0.5).to(tl.int8), scale


@triton.jit
def _block_scores(q_block, k_block_ptr, k_scale_ptr, pos_ok, b: tl.constexpr):
    """Block b's part of the scores [M, N]: its int8 q against the tile's int8 K of that block, an integer product on
    the tensor cores (IMMA), times both sides' scales."""
    q8, q_scale = q_block
    k8 = tl.load(k_block_ptr + b * 32, mask=pos_ok[None, :], other=0)  # [32, N]: K transposed, as stored
    k_scale = tl.load(k_scale_ptr + b, mask=pos_ok, other=0.0).to(tl.float32)
    return tl.dot(q8, k8, out_dtype=tl.int32).to(tl.float32) * q_scale[:, None] * k_scale[None, :]


# The partial results' strides follow the batch's split count, which follows its size: specialised on them, the kernels
# compiled again for each new batch size in the middle of serving (seconds each on an H200). So would the query tiles a
# sequence takes, which follow the step's longest chunk (Triton specialises an integer that is 1 or a multiple of 16).
_BY_SPLITS = ["stride_on", "stride_oh", "stride_os", "stride_ln", "stride_lh"]


# The sequences' columns are rows of one tensor in a prefill step (strata.stage_worker.model.step_layout): the second
# starts 8 bytes a sequence in, 16-byte aligned for an even number of sequences only, while a decode step's columns
# are tensors of their own. Specialised on that alignment, a prefill step compiles again where the warm-up compiled
# its launch at the other alignment: worked out from the warm-up's shapes after tests/gpu's
# test_after_warm_up_no_prefill_step_compiles_attention failed on an H100 (2026-12-07, its message cut off), not yet
# rerun there. Each column is read one value a program, so the alignment is worth nothing to the kernel.
_SEQUENCE_COLUMNS = ["slots_ptr", "q_starts_ptr", "q_lens_ptr", "kv_lens_ptr"]


@triton.jit(do_not_specialize=[*_BY_SPLITS, "q_tiles"], do_not_specialize_on_alignment=_SEQUENCE_COLUMNS)
def _attend_split(
    q_ptr, k_ptr, ks_ptr, v_ptr, vs_ptr, table_ptr, slots_ptr, q_starts_ptr, q_lens_ptr, kv_lens_ptr,
    o_part_ptr, lse_part_ptr,
    sm_scale, window, softcap,
    stride_qn, stride_qh,
    stride_kc, stride_ksc, stride_vc, stride_vsc,
    stride_table,
    stride_on, stride_oh, stride_os,
    stride_ln, stride_lh,
    n_rep, head_dim, q_tiles,
    K_Q8: tl.constexpr, V_Q8: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_T: tl.constexpr, REP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    F32_DOT: tl.constexpr, BLOCKED_SCALES: tl.constexpr, SOFTCAP: tl.constexpr, MIN_SPLIT: tl.constexpr,
    DOT_F16: tl.constexpr, INT8_SCORES: tl.constexpr, CELLS_AHEAD: tl.constexpr, PACKED_INT8: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(PDL)  # q, the step's new cells and the sequences' lengths all come from kernels ahead
    seq_tile = tl.program_id(0)
    group = tl.program_id(1)
    split = tl.program_id(2)
    splits = tl.num_programs(2)
    seq = seq_tile // q_tiles
    tile = seq_tile % q_tiles

    # All four before any branch: each dependent round trip to memory is a microsecond of a short sequence's time.
    q_len = tl.load(q_lens_ptr + seq)
    kv_len = tl.load(kv_lens_ptr + seq)
    q_start = tl.load(q_starts_ptr + seq)
    slot = tl.load(slots_ptr + seq)
    if tile * BLOCK_T >= q_len:
        return

    # Rows of the M dimension: (query position t of the tile, head r of the group).
    offs_m = tl.arange(0, BLOCK_T * REP)
    t = tile * BLOCK_T + offs_m // REP
    r = offs_m % REP
    row_ok = (t < q_len) & (r < n_rep)
    head = group * n_rep + r
    q_pos = kv_len - q_len + t  # the absolute position of each row: it sees keys at q_pos - window + 1..q_pos
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim

    # This split's positions: whole tiles, only as far as the tile's last query can see, and from where the window of
    # the tile's first query starts (the caller passes a window longer than any sequence where there is none).
    visible = tl.minimum(kv_len, kv_len - q_len + tl.minimum(q_len, (tile + 1) * BLOCK_T))
    lowest = tl.maximum(0, kv_len - q_len + tile * BLOCK_T - window + 1)
    per_split = tl.maximum(tl.cdiv(tl.cdiv(visible - lowest, splits), BLOCK_N) * BLOCK_N, MIN_SPLIT)
    begin = lowest + split * per_split
    end = tl.minimum(begin + per_split, visible)
    rows = (q_start + t).to(tl.int64)
    if begin >= end:
        # A split past the sequence's end says so in its log-sum-exp alone (the merge reads none of its values) and
        # loads nothing: one stream's 128 splits at 300 positions no longer write 8 MB of empty partial outputs.
        tl.store(lse_part_ptr + rows * stride_ln + head * stride_lh + split, float("-inf"), mask=row_ok)
        return

    q_rows = rows * stride_qn + head.to(tl.int64) * stride_qh
    tiles = tl.float16 if DOT_F16 else q_ptr.dtype.element_ty  # the dtype of the dot products' 16- or 32-bit tiles
    if INT8_SCORES:  # q8_0 K of heads of 128 values: four blocks of 32, each q block rounded to int8 once
        q_0 = _q_block_int8(q_ptr, q_rows, row_ok, sm_scale, 0)
        q_1 = _q_block_int8(q_ptr, q_rows, row_ok, sm_scale, 32)
        q_2 = _q_block_int8(q_ptr, q_rows, row_ok, sm_scale, 64)
        q_3 = _q_block_int8(q_ptr, q_rows, row_ok, sm_scale, 96)
    else:
        q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        q = (q.to(tl.float32) * sm_scale).to(tiles)

    m_i = tl.full([BLOCK_T * REP], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_T * REP], dtype=tl.float32)
    acc = tl.zeros([BLOCK_T * REP, BLOCK_D], dtype=tl.float32)
    column = group * head_dim + offs_d  # [D] this group's values in a cell's row
    table_row = table_ptr + slot.to(tl.int64) * stride_table
    if CELLS_AHEAD:  # the first tile's pages; each tile then loads the next one's (LaunchConfig.cells_ahead)
        ahead = begin + tl.arange(0, BLOCK_N)
        next_page = tl.load(table_row + ahead // PAGE, mask=ahead < end, other=0)
    for start in range(begin, end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        if CELLS_AHEAD:
            page = next_page
            ahead = pos + BLOCK_N
            next_page = tl.load(table_row + ahead // PAGE, mask=ahead < end, other=0)
        else:
            page = tl.load(table_row + pos // PAGE, mask=pos_ok, other=0)
        cell = (page * PAGE + pos % PAGE).to(tl.int64)
        kv_mask = pos_ok[:, None] & d_ok[None, :]

        if INT8_SCORES:
            k_block_ptr = k_ptr + cell[None, :] * stride_kc + group * head_dim + tl.arange(0, 32)[:, None]
            k_scale_ptr = ks_ptr + cell * stride_ksc + group * (head_dim // 32)
            scores = _block_scores(q_0, k_block_ptr, k_scale_ptr, pos_ok, 0)
            scores += _block_scores(q_1, k_block_ptr, k_scale_ptr, pos_ok, 1)
            scores += _block_scores(q_2, k_block_ptr, k_scale_ptr, pos_ok, 2)
            scores += _block_scores(q_3, k_block_ptr, k_scale_ptr, pos_ok, 3)
        else:
            k = tl.load(k_ptr + cell[:, None] * stride_kc + column[None, :], mask=kv_mask, other=0)
            if K_Q8:
                k = _dequantise(k, ks_ptr, cell, stride_ksc, group * head_dim, pos_ok, d_ok,
                                BLOCK_N, BLOCK_D, BLOCKED_SCALES, DOT_F16, PACKED_INT8)  # fmt: skip
            k = k.to(tiles)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") if F32_DOT else tl.dot(q, tl.trans(k))
        if SOFTCAP:  # softcap * tanh(scores / softcap), with tanh(x) = 2 sigmoid(2x) - 1
            scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)
        seen = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window)  # [M, N]
        scores = tl.where(seen, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays empty
        p = tl.where(seen, tl.exp(scores - m_safe[:, None]), 0.0)
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v = tl.load(v_ptr + cell[:, None] * stride_vc + column[None, :], mask=kv_mask, other=0)
        if V_Q8:
            v = _dequantise(v, vs_ptr, cell, stride_vsc, group * head_dim, pos_ok, d_ok,
                            BLOCK_N, BLOCK_D, BLOCKED_SCALES, DOT_F16, PACKED_INT8)  # fmt: skip
        v = v.to(tiles)
        if F32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    o_off = rows[:, None] * stride_on + head[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    tl.store(o_part_ptr + o_off, out, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_part_ptr + rows * stride_ln + head * stride_lh + split, lse, mask=row_ok)


@triton.jit(do_not_specialize=[*_BY_SPLITS, "splits"])
def _merge_splits(
    o_part_ptr, lse_part_ptr, out_ptr,
    stride_on, stride_oh, stride_os, stride_ln, stride_lh, stride_outn, stride_outh,
    splits, head_dim,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (row, head, part): values [part * BLOCK_D, (part + 1) * BLOCK_D) of one row's head, from its splits."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    s_ok = offs_s < splits
    lse = tl.load(lse_part_ptr + row * stride_ln + head * stride_lh + offs_s, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, axis=0)
    weight = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - top))  # [S]
    parts = tl.load(
        o_part_ptr + row * stride_on + head * stride_oh + offs_s[:, None] * stride_os + offs_d[None, :],
        mask=s_ok[:, None] & (offs_d[None, :] < head_dim) & (weight[:, None] > 0.0),
        other=0.0,
    )  # [S, D]
    out = tl.sum(parts * weight[:, None], axis=0) / tl.sum(weight, axis=0)
    tl.store(
        out_ptr + row * stride_outn + head * stride_outh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < head_dim,
    )


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


@dataclass(frozen=True)
class LaunchConfig:
    """The kernel's tile and launch shape; `bench/depth.py --kernel-only` measures the alternatives."""

    block_n: int = 64  # positions per tile (halved for head dims over 128)
    lone_block_n: int = 32  # ... when the sequences alone would leave most multiprocessors idle
    num_warps: int | None = None  # None: by the batch's shape (launch_shape)
    num_stages: int = 2
    # ... for a lone stream's launch: one. On an H100 (2026-12-07, --kernel-only, one layer) a lone stream's launch
    # took 11.6 us at 300 positions against 12.6 with two, 15.7 against 17.1 at 4K, 52.9 against 54.0 at 32K and 162.4
    # against 166.8 at 128K: a split of a short sequence is one tile, which a pipeline only delays.
    lone_stages: int = 1
    # The most values of the [splits, head values] f32 tile one merge program holds: a row's head is cut into as many
    # programs as that takes. A lone stream's 128 splits of a whole 128-value head were 16,384 values a program: 255
    # registers a thread and 72 bytes of spills (compiled offline, Triton 3.6), 7.8 us a layer in an H100's profile of
    # a one-stream step at depth 300 (2026-12-07); 32 values of the head take 44 registers, and the lone launch with
    # its merge took 9.5 us at 300 positions against 12.1 with whole heads (H100, 2026-12-07, --kernel-only). A batch's
    # few splits and a prefill chunk's one keep a whole head a program: their rows are programs enough.
    merge_values: int = 4096
    # Each tile loads the next tile's cells from the table, so a tile's K/V loads wait on one round trip to memory, not
    # two in a row (its cells, then K/V): 13 instructions more a tile (1,803, offline), and on its own within 2% of
    # the plain loads (an H100, 2026-12-07, --kernel-only: 48.2 us against 49.2 at 32K, 154.9 against 159.4 at 128K,
    # 100.3 against 101.3 for 16 streams at 4K); with `lone_packed_int8` it pays (below).
    cells_ahead: bool = True
    # q8_0 values converted to f16 four bytes a register in PTX (`_int8x4_to_f16`) on a GPU; the interpreter (CPU) keeps
    # `_int8_to_f16`, the same values. Compiled offline (Triton 3.6, sm_90a, bench/sass.py) the lone tile takes 1,586
    # instructions against 1,790, 255 registers, no stack. On an H100 (2026-12-07, --kernel-only, one layer), a lone
    # stream's launch with cells a tile ahead: 9.1 us at 300 positions against 9.5, 10.5 against 11.1 at 4K, 13.9
    # against 15.0 at 8K, 22.4 against 24.6 at 16K, 44.0 against 49.2 at 32K, 142.4 against 159.4 at 128K (2.0 TB/s of
    # q8_0 K/V); without cells ahead about half of that. A batch's tile (64 positions, 2 warps) spills 144 bytes with
    # it (offline), and 16 streams at 4K took 109.2 us against 101.3: lone launches only.
    packed_int8: bool = False
    lone_packed_int8: bool = True  # ... for a lone stream's launch
    waves: int = 8  # programs per multiprocessor the splits aim for
    max_splits: int = 128
    # Positions a split takes at least (0: its tile). A short sequence is latency-bound: more splits of one tile each
    # finish sooner than fewer of two (an H100, 300 positions: 128 positions a split cost 1.5x).
    min_split: int = 0
    f16_dot: bool = True  # q8_0 and f16 K/V under a 16-bit q: dot products in f16 (see `_int8_to_f16`)
    # A program's query rows (positions x the GQA group) for a chunk of more than 64 (heads of up to 128 values): each
    # K/V tile serves twice the queries. On an H200 (2026-11-29, Llama-3-8B heads, q8_0), against 64 rows: a 256-token
    # chunk after 3,840 positions 216 us against 403 (64 rows took 2 warps there, as the batch's size chose), after
    # 32,512 1,184 against 2,736; a 4,096-token chunk after 126,976 59.6 ms against 65.0; from position 0, 0.95x (a
    # lone long prompt takes flash attention instead). Fewer rows (speculative steps) keep 64, and 256-value heads too.
    chunk_rows: int = 128
    # Scores as integer products: q rounded to int8 a block of 32 (llama.cpp's q8_1 rounding of Q) against q8_0 K of
    # 128-value heads, on the tensor cores, with no K dequantised. Compiled offline for sm_90a (Triton 3.6,
    # bench/sass.py), one stream's decode tile took 1,539 instructions against 1,778 and the 16-stream launch 1,527
    # against 1,791. Timed on an H100 (2026-12-07, bench/depth.py --kernel-only): one stream 5-11% slower at 4K-128K
    # (its lone tile waits on loads, not on issue), 16 streams at 4K 5.5% faster, about 2% of their step; off, since
    # that is not worth q's rounding (6.6e-3 relative at 300 positions against bf16's 1.9e-3).
    int8_scores: bool = False


DEFAULT = LaunchConfig()
# A program's query rows in a step of a few positions (speculative ones) or of 256-value heads; longer chunks take
# `LaunchConfig.chunk_rows`.
SHORT_CHUNK_ROWS = 64


def int8_scores_apply(keys: Tensor, key_scales: Tensor | None, head_dim: int, dot_f16: bool) -> bool:
    """Where `LaunchConfig.int8_scores` can take a layer: q8_0 K, 128-value heads (four q8_0 blocks, the kernel's
    unrolled blocks), 16-bit dot products."""
    return key_scales is not None and keys.dtype == torch.int8 and head_dim == 128 and dot_f16


@dataclass(frozen=True)
class Launch:
    splits: int  # programs per sequence, tile and KV head
    warps: int
    block_n: int
    stages: int = 2
    packed_int8: bool = False  # LaunchConfig.packed_int8


def launch_shape(*, programs: int, rows: int, device: torch.device, config: LaunchConfig = DEFAULT) -> Launch:
    """The launch from the batch's shape only, so a CUDA graph replays at any depth.

    Splits give enough programs to fill the GPU `waves` times over, whatever the lengths (empty splits end at once).
    Measured on an H100 (bench/depth.py --kernel-only, q8_0, Llama-3-8B heads): a lone long stream reads fastest
    with many one-warp programs of 32-position tiles (1.75 TB/s at 131,072 positions against 1.49 with two warps and
    64), each warp's registers holding its own tiles; a batch that gives every multiprocessor a program or more with
    two warps and 64 (16 streams at 4,096: 1.38 TB/s against 1.25). `rows` is a program's query rows: one warp holds
    the 16 of a decode step's GQA group, not the 64 of a short chunk, and the 128 of a long one take 4 warps whatever
    the number of programs (see `LaunchConfig.chunk_rows`)."""
    sms = _multiprocessors(device)
    splits = max(1, min(config.max_splits, -(-config.waves * sms // max(programs, 1))))
    lone = programs * 4 <= sms and rows <= 16
    warps = config.num_warps or (1 if lone else 4 if rows > SHORT_CHUNK_ROWS else 2 if programs < sms else 4)
    return Launch(splits=splits, warps=warps, block_n=config.lone_block_n if lone else config.block_n,
                  stages=config.lone_stages if lone else config.num_stages,
                  packed_int8=config.lone_packed_int8 if lone else config.packed_int8)  # fmt: skip


def saturating_programs(device: torch.device, config: LaunchConfig = DEFAULT) -> int:
    """The programs from which a launch's shape no longer changes with more: one split each, the most warps."""
    return config.waves * _multiprocessors(device)


@dataclass(frozen=True)
class TileShape:
    rep: int  # a program's rows of one query position: the GQA group, padded to a power of two
    block_t: int  # query positions a program takes
    block_d: int
    q_tiles: int  # programs a sequence's query positions need
    block_n: int  # key positions a tile
    launch: Launch

    @property
    def variant(self) -> tuple[object, ...]:
        """What picks the compiled kernels of a launch beyond the layer's fixed attributes: a launch of a new variant
        compiles (seconds), so a stage's warm-up runs a step of each its batches meet
        (strata.stage_worker.warm_steps)."""
        splits = triton.next_power_of_2(self.launch.splits)  # the merge's tile
        return (self.block_t, self.block_n, self.launch.warps, splits, self.launch.stages, self.launch.packed_int8)


def tile_shape(
    *, n_seq: int, max_q_len: int, n_head: int, n_head_kv: int, head_dim: int, device: torch.device,
    config: LaunchConfig = DEFAULT,
) -> TileShape:  # fmt: skip
    """How a batch of `n_seq` sequences of up to `max_q_len` query positions is tiled and launched."""
    rep = triton.next_power_of_2(n_head // n_head_kv)
    block_d = max(16, triton.next_power_of_2(head_dim))
    short = max_q_len * rep <= SHORT_CHUNK_ROWS or block_d > 128
    rows = 16 if max_q_len == 1 else SHORT_CHUNK_ROWS if short else config.chunk_rows
    block_t = max(1, rows // rep)
    q_tiles = triton.cdiv(max_q_len, block_t)
    launch = launch_shape(programs=n_seq * q_tiles * n_head_kv, rows=block_t * rep, device=device, config=config)
    block_n = launch.block_n if block_d <= 128 else max(16, launch.block_n // 2)  # the dots take K >= 16
    return TileShape(rep=rep, block_t=block_t, block_d=block_d, q_tiles=q_tiles, block_n=block_n, launch=launch)


def paged_attention(
    q: Tensor,
    *,
    keys: Tensor,
    key_scales: Tensor | None,
    values: Tensor,
    value_scales: Tensor | None,
    table: Tensor,
    slots: Tensor,
    q_starts: Tensor,
    q_lens: Tensor,
    kv_lens: Tensor,
    max_q_len: int,
    n_head_kv: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    page: int = 1,
    config: LaunchConfig = DEFAULT,
) -> Tensor:
    """q: [N, H, hd]; keys/values: [cells, Hkv * hd] as stored (int8 with [cells, Hkv * hd / 32] f16 scales for
    q8_0); table: [slots, pages]; per sequence (device tensors): its table row, first row in q, query rows and
    visible positions; scores scaled by `scale`, over the last `window` positions (0: all), soft-capped at `softcap`
    (0: not). Returns [N, H, hd] in q's dtype."""
    for name, column in (("slots", slots), ("q_starts", q_starts), ("q_lens", q_lens), ("kv_lens", kv_lens)):
        if not column.is_contiguous():  # the kernel indexes them as dense arrays: a strided view reads other values
            raise ValueError(f"the sequences' {name} must be one contiguous tensor, not strided {column.stride()}")
    n, n_head, head_dim = q.shape
    n_rep = n_head // n_head_kv
    shape = tile_shape(
        n_seq=slots.shape[0], max_q_len=max_q_len, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
        device=q.device, config=config,
    )  # fmt: skip
    rep, block_t, block_d, q_tiles, block_n = shape.rep, shape.block_t, shape.block_d, shape.q_tiles, shape.block_n
    launch = shape.launch
    splits = launch.splits
    o_part = torch.empty(n, n_head, splits, head_dim, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(n, n_head, splits, dtype=torch.float32, device=q.device)
    f16_tiles = keys.dtype in (torch.int8, torch.float16) and values.dtype in (torch.int8, torch.float16)
    dot_f16 = config.f16_dot and q.dtype in (torch.bfloat16, torch.float16) and f16_tiles
    _attend_split[(slots.shape[0] * q_tiles, n_head_kv, splits)](
        q, keys, keys if key_scales is None else key_scales, values, values if value_scales is None else value_scales,
        table, slots, q_starts, q_lens, kv_lens, o_part, lse_part,
        scale, window if window > 0 else NO_WINDOW, softcap,
        q.stride(0), q.stride(1),
        keys.stride(0), 0 if key_scales is None else key_scales.stride(0),
        values.stride(0), 0 if value_scales is None else value_scales.stride(0),
        table.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        n_rep, head_dim, q_tiles,
        K_Q8=key_scales is not None, V_Q8=value_scales is not None, PAGE=page,
        BLOCK_T=block_t, REP=rep, BLOCK_N=block_n, BLOCK_D=block_d,
        F32_DOT=q.dtype == torch.float32, BLOCKED_SCALES=head_dim % 32 == 0 and block_d == head_dim,
        SOFTCAP=softcap > 0, MIN_SPLIT=max(config.min_split, block_n),
        DOT_F16=dot_f16, INT8_SCORES=config.int8_scores and int8_scores_apply(keys, key_scales, head_dim, dot_f16),
        CELLS_AHEAD=config.cells_ahead, PACKED_INT8=launch.packed_int8 and dot_f16 and q.device.type == "cuda",
        num_warps=launch.warps, num_stages=launch.stages, **dependent_launch.options(q.device),
    )  # fmt: skip
    out = torch.empty_like(q)
    block_s = triton.next_power_of_2(splits)
    merge_d = min(block_d, max(16, config.merge_values // block_s))
    _merge_splits[(n, n_head, triton.cdiv(head_dim, merge_d))](
        o_part, lse_part, out,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        out.stride(0), out.stride(1),
        splits, head_dim,
        BLOCK_S=block_s, BLOCK_D=merge_d, **dependent_launch.options(q.device),
    )  # fmt: skip
    return out
