"""Attention of a step's query rows over the KV pool, read through the pool's table: one function, two bodies.

`attend_pool` is what the model calls. On a CUDA device it runs the Triton kernel (strata.stage_worker.kernels.
paged_attention_triton), which reads each sequence's cells in place in their stored type; anywhere else, and as the
kernel's test oracle, it runs `reference`: gather the cells, dequantise them to f32, and attend in f32 with
`attend_dense`. An AttentionRule carries what differs between layers: the scale, a sliding window (Gemma), and a
soft-cap on the scores (Gemma 2).

The kernel is registered as a torch custom op so that torch.compile keeps it whole inside a compiled block (and a
CUDA graph replays it): its inputs are device tensors only, so lengths change without a new graph.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from strata.stage_worker.kv_stores import LayerCache
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right


@dataclass(frozen=True)
class AttentionRule:
    """How one layer turns q.k into weights."""

    scale: float  # scores are q.k times this
    window: int = 0  # a query sees itself and the window - 1 positions before it; 0: every earlier position
    softcap: float = 0.0  # scores -> softcap * tanh(scores / softcap) before the mask; 0: none


def attend_dense(q: Tensor, keys: Tensor, values: Tensor, *, rule: AttentionRule) -> Tensor:
    """Causal attention of T query rows, the last T of S positions, over all S: q [1, H, T, hd], keys and values
    [1, Hkv, S, hd]. SDPA with a mask when scores need no soft-cap; the plain formula when they do."""
    t, s = q.shape[2], keys.shape[2]
    gqa = q.shape[1] != keys.shape[1]
    if not rule.window and not rule.softcap:
        mask = causal_lower_right(t, s)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa, scale=rule.scale)
    q_pos = torch.arange(s - t, s, device=q.device)[:, None]  # [T, 1]
    k_pos = torch.arange(s, device=q.device)[None, :]  # [1, S]
    allowed = k_pos <= q_pos
    if rule.window:
        allowed &= q_pos - k_pos < rule.window
    if not rule.softcap:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, enable_gqa=gqa, scale=rule.scale)
    rep = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)  # [1, H, S, hd]
    scores = (q @ keys.transpose(-1, -2)) * rule.scale  # [1, H, T, S]
    scores = rule.softcap * torch.tanh(scores / rule.softcap)
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    return weights.to(values.dtype) @ values


@dataclass(frozen=True)
class Sequences:
    """The sequences of one attention call: which rows of q each one owns and how many positions it sees."""

    slots: Tensor  # [S] row of the pool's table
    q_starts: Tensor  # [S] first row of q
    q_lens: Tensor  # [S] rows of q; they sit at the last q_len of the kv_len positions
    kv_lens: Tensor  # [S] positions 0..kv_len-1 of the slot are visible (the last row sees all of them)
    max_q_len: int  # a host bound on q_lens: the kernel's grid


def reference(
    q: Tensor, cache: LayerCache, *, table: Tensor, sequences: Sequences, n_head_kv: int, rule: AttentionRule
) -> Tensor:
    """The plain function: per sequence, gather its cells, dequantise to f32, attend in f32. q: [N, H, hd].

    As the kernel does, it reads from the first position the sequence's first query row sees: with a window, the
    table's columns before it may name cells that other positions have taken since."""
    head_dim = q.shape[-1]
    out = torch.empty_like(q)
    columns = (sequences.slots, sequences.q_starts, sequences.q_lens, sequences.kv_lens)
    for slot, q_start, q_len, kv_len in zip(*(c.tolist() for c in columns), strict=True):
        lowest = max(0, kv_len - q_len - rule.window + 1) if rule.window else 0
        cells = table[slot, lowest:kv_len]
        seen = kv_len - lowest
        keys = cache.keys.read(cells, dtype=torch.float32).view(1, seen, n_head_kv, head_dim).transpose(1, 2)
        values = cache.values.read(cells, dtype=torch.float32).view(1, seen, n_head_kv, head_dim).transpose(1, 2)
        rows = q[q_start : q_start + q_len].float().transpose(0, 1)[None]  # [1, H, T, hd]
        attended = attend_dense(rows, keys, values, rule=rule)
        out[q_start : q_start + q_len] = attended[0].transpose(0, 1).to(q.dtype)
    return out


def round_q_int8(q: Tensor, scale: float) -> Tensor:
    """q as the kernel's integer scores see it (LaunchConfig.int8_scores), in f32: q * scale rounded to int8 a block
    of 32 values on the block's own scale (its largest magnitude over 127, halves away from zero), then / scale. The
    reference of those scores is `reference` on this q."""
    x = q.float() * scale
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    step = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    steps = blocks / torch.where(step > 0, step, 1.0)
    rounded = torch.where(steps >= 0, steps + 0.5, steps - 0.5).trunc() * step
    return rounded.reshape(x.shape) / scale


@torch.library.custom_op("strata::paged_attention", mutates_args=())
def _paged_attention_op(
    q: Tensor,
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
    window: int,
    softcap: float,
) -> Tensor:
    from strata.stage_worker.kernels.paged_attention_triton import paged_attention

    # Triton launches on the current device's stream, whatever the tensors say (under its interpreter, on the CPU).
    with torch.cuda.device(q.device) if q.device.type == "cuda" else nullcontext():
        return paged_attention(
            q, keys=keys, key_scales=key_scales, values=values, value_scales=value_scales, table=table, slots=slots,
            q_starts=q_starts, q_lens=q_lens, kv_lens=kv_lens, max_q_len=max_q_len, n_head_kv=n_head_kv,
            scale=scale, window=window, softcap=softcap,
        )  # fmt: skip


@_paged_attention_op.register_fake
def _(
    q: Tensor,
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
    window: int,
    softcap: float,
) -> Tensor:
    return torch.empty_like(q)


def kernel(
    q: Tensor, cache: LayerCache, *, table: Tensor, sequences: Sequences, n_head_kv: int, rule: AttentionRule
) -> Tensor:
    """The Triton kernel on the same inputs as `reference` (q made contiguous: the kernel walks head_dim densely)."""
    s = sequences
    out: Tensor = _paged_attention_op(
        q.contiguous(), cache.keys.values, cache.keys.scales, cache.values.values, cache.values.scales, table,
        s.slots, s.q_starts, s.q_lens, s.kv_lens, s.max_q_len, n_head_kv, rule.scale, rule.window, rule.softcap,
    )  # fmt: skip
    return out


# Flash attention kernels, best first. Not cuDNN: it builds an execution plan for every new (T, S) shape, and
# prompts come in every length, so a new prompt would wait for a plan instead of attending.
FRESH_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attend_fresh(q: Tensor, cache: LayerCache, *, cells: Tensor, n_head_kv: int, rule: AttentionRule) -> Tensor:
    """Causal attention of one prompt from position 0, q [T, H, hd], over its T cells (in order), read once into q's
    dtype: the pool's values, as the pool kernel reads them, through `attend_dense` (with T = S its causal mask is
    SDPA's is_causal, which flash attention takes). Plain causal scores only (no window, no soft-cap)."""
    if rule.window or rule.softcap:
        raise ValueError("attend_fresh takes plain causal attention: a windowed or soft-capped layer reads the pool")
    t, _, head_dim = q.shape
    keys, values = cache.read(cells)  # [T, Hkv * hd] each
    k = keys.to(q.dtype).view(1, t, n_head_kv, head_dim).transpose(1, 2)
    v = values.to(q.dtype).view(1, t, n_head_kv, head_dim).transpose(1, 2)
    with sdpa_kernel(FRESH_ATTENTION):
        out = attend_dense(q.transpose(0, 1)[None], k, v, rule=rule)
    return out[0].transpose(0, 1)


def attend_pool(
    q: Tensor,
    cache: LayerCache,
    *,
    table: Tensor,
    sequences: Sequences,
    n_head_kv: int,
    rule: AttentionRule | None = None,  # None: plain causal attention scaled by 1 / sqrt(head_dim)
) -> Tensor:
    body = kernel if q.device.type == "cuda" else reference
    rule = rule or AttentionRule(scale=q.shape[-1] ** -0.5)
    return body(q, cache, table=table, sequences=sequences, n_head_kv=n_head_kv, rule=rule)
