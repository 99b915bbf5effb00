"""The greedy pick of a decode step in Triton: each row's argmax over the vocabulary and its log-probability.

Why a kernel of our own: one row of 128K logits is a single reduction, and torch.compile with dynamic shapes gave it
one thread block (62 us a step on an H100, where the whole step is about 4 ms). Here the row is split into chunks
across programs, each keeping its maximum, the first index of it and sum(exp(x - max)); a second launch merges the
chunks: the token is the first index of the largest maximum, its log-probability max - logsumexp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

CHUNK = 2048  # logits a program: 63 programs a row for a 128K vocabulary


@triton.jit
def _chunks(logits_ptr, top_ptr, index_ptr, sums_ptr, vocab, stride_row, n_chunks, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row * stride_row + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    top = tl.max(x, axis=0)
    first = tl.min(tl.where(x == top, offs, vocab), axis=0)  # the first index of the maximum, as torch.argmax
    safe = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.exp(x - safe), axis=0)
    tl.store(top_ptr + row * n_chunks + chunk, top)
    tl.store(index_ptr + row * n_chunks + chunk, first)
    tl.store(sums_ptr + row * n_chunks + chunk, total)


@triton.jit
def _merge(top_ptr, index_ptr, sums_ptr, out_ptr, n_chunks, rows, vocab, BLOCK_S: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_S)
    ok = offs < n_chunks
    top = tl.load(top_ptr + row * n_chunks + offs, mask=ok, other=float("-inf"))
    index = tl.load(index_ptr + row * n_chunks + offs, mask=ok, other=vocab)
    sums = tl.load(sums_ptr + row * n_chunks + offs, mask=ok, other=0.0)
    best = tl.max(top, axis=0)
    token = tl.min(tl.where(top == best, index, vocab), axis=0)
    safe = tl.where(top == float("-inf"), best, top)
    total = tl.sum(sums * tl.exp(safe - best), axis=0)
    tl.store(out_ptr + row, token.to(tl.float32))
    tl.store(out_ptr + rows + row, -tl.log(total))  # the token's logit is the maximum: logit - lse = -log(sum)


def greedy_pick(logits: Tensor) -> Tensor:
    """logits [B, vocab] -> [2, B] f32: each row's argmax token (as a float) and its log-probability."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    n_chunks = triton.cdiv(vocab, CHUNK)
    top = torch.empty((rows, n_chunks), dtype=torch.float32, device=logits.device)
    index = torch.empty((rows, n_chunks), dtype=torch.int32, device=logits.device)
    sums = torch.empty((rows, n_chunks), dtype=torch.float32, device=logits.device)
    out = torch.empty((2, rows), dtype=torch.float32, device=logits.device)
    if rows == 0:
        return out
    _chunks[(rows, n_chunks)](logits, top, index, sums, vocab, logits.stride(0), n_chunks, CHUNK=CHUNK, num_warps=4)
    _merge[(rows,)](top, index, sums, out, n_chunks, rows, vocab, BLOCK_S=triton.next_power_of_2(n_chunks),
                    num_warps=1)  # fmt: skip
    return out
