"""Where a quantised product's outputs go, for the kernels of strata.stage_worker.kernels.quant_matmul_triton,
quant_dot8_triton and quant_gemm_triton: a product split along K (programs enough to fill the GPU) stores f32 parts
that its last program adds (`split_output`, `sum_splits`); a gated feed-forward's gate/up product stores
act(gate) * up, each program taking gate rows and the matching up rows (`product_output`, `program_rows`,
`store_activated`); `store_product` stores either.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from strata.stage_worker.kernels.quant_blocks_triton import GATE_NONE, act_times_up
from torch import Tensor


@functools.cache
def multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


WAVES = 4  # programs a multiprocessor that split_k aims for


@triton.jit
def program_rows(pid_n, half_n, N, BLOCK_N: tl.constexpr, PAIRED: tl.constexpr):
    """A program's BLOCK_N weight rows. PAIRED (a GATE_ constant): the matrix is a gated feed-forward's gate rows
    [0, half_n) over its up rows [half_n, N), and the program takes gate row u at even positions and up row
    half_n + u beside it, BLOCK_N / 2 of each (past the end: N, which the caller clamps for loads and never stores)."""
    if PAIRED == GATE_NONE:
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    else:
        pairs = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N) // 2
        rows = tl.where(pairs < half_n, pairs + (tl.arange(0, BLOCK_N) % 2) * half_n, N)
    return rows


@triton.jit
def store_activated(out_ptr, out, m, M, pid_n, half_n, som, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    GATE: tl.constexpr):  # fmt: skip
    """`program_rows`' paired outputs out [BLOCK_M, BLOCK_N] f32 as act(gate) * up into out [M, half_n]: each of
    gate and up rounded to out's dtype first, as a product's output is, then `act_times_up` in f32, rounded once."""
    rounded = out.to(out_ptr.dtype.element_ty).to(tl.float32)
    gate, up = tl.split(tl.reshape(rounded, (BLOCK_M, BLOCK_N // 2, 2)))
    units = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    ok = (m < M)[:, None] & (units < half_n)[None, :]
    tl.store(out_ptr + m[:, None] * som + units[None, :], act_times_up(gate, up, GATE).to(out_ptr.dtype.element_ty),
             mask=ok)  # fmt: skip


def split_k(x: Tensor, *, n: int, n_chunks: int, chunks: int, programs: int, splits: int | None) -> tuple[int, Tensor]:
    """(chunks per split, out): splits along K enough for WAVES programs a multiprocessor (or `splits`), out
    [M, N] in x's dtype for one, else [splits, M, N] f32 partial sums that the caller adds."""
    steps = triton.cdiv(n_chunks, chunks)
    wanted = splits or max(1, min(steps, WAVES * multiprocessors(x.device) // programs))
    chunks_per_split = triton.cdiv(steps, wanted) * chunks
    splits = triton.cdiv(n_chunks, chunks_per_split)
    if splits == 1:
        return chunks_per_split, torch.empty((x.shape[0], n), device=x.device, dtype=x.dtype)
    return chunks_per_split, torch.empty((splits, x.shape[0], n), device=x.device, dtype=torch.float32)


@triton.jit
def sum_splits(part_ptr, out_ptr, count_ptr, part, m, rows, ok, sps, spm, som, splits):
    """The last of a tile's K splits to finish adds the splits' parts into out [M, N] in out's dtype, so a split
    product takes no launches of its own to add them and round (the one-row Q4_K down projection of an H100's
    Q4_K_M step, 2026-12-07: a torch reduction of 3.6 us and a rounding copy of about 1 us, in 16 layers). Each split
    stores its part [M, N] (f32, at part_ptr + split * sps), then counts itself at count_ptr (zero before the launch):
    the atomic add releases this program's stores (every thread's, after the barrier) and acquires the others', so
    the one that counts last reads every part back, from L2, in split order."""
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel")
    if arrived == splits - 1:
        total = tl.zeros_like(part)
        for split in range(0, splits):
            at = part_ptr + split * sps + m[:, None] * spm + rows[None, :]
            total += tl.load(at, mask=ok, other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + m[:, None] * som + rows[None, :], total.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def store_product(out_ptr, result_ptr, counts_ptr, out, m, M, rows, N, pid_n, pid_k, half_n, sos, som, sres,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAIRED: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
    """A program's outputs out [BLOCK_M, BLOCK_N] f32 of `rows` (`program_rows`) where `product_output` put them:
    act(gate) * up where PAIRED says so (`store_activated`); else its split's part, and with SPLIT the splits' sum
    into result (`sum_splits`)."""
    if PAIRED != GATE_NONE:
        store_activated(out_ptr, out, m, M, pid_n, half_n, som, BLOCK_M, BLOCK_N, PAIRED)
    else:
        ok = (m < M)[:, None] & (rows < N)[None, :]
        tl.store(out_ptr + pid_k * sos + m[:, None] * som + rows[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)
        if SPLIT:
            sum_splits(out_ptr, result_ptr, counts_ptr + pid_n, out, m, rows, ok, sos, som, sres, tl.num_programs(1))


@dataclass(frozen=True)
class SplitOutput:
    """Where a product split along K puts its parts and its result (`split_output`)."""

    parts: Tensor  # [splits, M, N] f32, or the result itself for one split
    result: Tensor  # [M, N] in x's dtype
    counts: Tensor  # [programs] int32 zeros, one a tile of N (the result for one split: never read)

    @property
    def splits(self) -> int:
        return 1 if self.parts.dim() == 2 else self.parts.shape[0]

    @property
    def split_stride(self) -> int:
        """The parts' stride from one split to the next (0 for one split: the kernels' `sos`)."""
        return self.parts.stride(0) if self.splits > 1 else 0


def product_output(
    x: Tensor, *, n: int, n_chunks: int, chunks: int, block_n: int, splits: int | None, activate: int
) -> tuple[int, int, SplitOutput]:
    """(programs, chunks per split, outputs) of a product of n weight rows, `block_n` a program: `split_output`'s
    split; or with `activate` (a GATE_ constant), programs that store act(gate) * up (`program_rows`,
    `store_activated`): half of n's rows a program's pairs, one split, the result [M, n / 2] in x's dtype."""
    if not activate:
        programs = triton.cdiv(n, block_n)
        chunks_per_split, out = split_output(x, n=n, n_chunks=n_chunks, chunks=chunks, programs=programs,
                                             splits=splits)  # fmt: skip
        return programs, chunks_per_split, out
    if n % 2 or block_n % 2 or (splits or 1) != 1:
        raise ValueError(f"gate over up takes an even number of rows ({n}), a program of pairs ({block_n} rows) and "
                         f"one split ({splits})")  # fmt: skip
    activated = x.new_empty((x.shape[0], n // 2))
    out = SplitOutput(parts=activated, result=activated, counts=activated)
    return triton.cdiv(n // 2, block_n // 2), triton.cdiv(n_chunks, chunks) * chunks, out


def split_output(
    x: Tensor, *, n: int, n_chunks: int, chunks: int, programs: int, splits: int | None
) -> tuple[int, SplitOutput]:
    """`split_k`'s split with the result and counters `sum_splits` needs: (chunks per split, outputs)."""
    chunks_per_split, out = split_k(x, n=n, n_chunks=n_chunks, chunks=chunks, programs=programs, splits=splits)
    if out.dim() == 2:
        return chunks_per_split, SplitOutput(parts=out, result=out, counts=out)
    result = torch.empty((x.shape[0], n), device=x.device, dtype=x.dtype)
    counts = torch.zeros(programs, device=x.device, dtype=torch.int32)
    return chunks_per_split, SplitOutput(parts=out, result=result, counts=counts)
