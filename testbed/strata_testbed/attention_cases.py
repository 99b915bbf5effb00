"""Named cases for the pool attention kernel (and the flash path of a lone fresh prompt) against its reference: one
table for the CPU tests (the kernel under Triton's interpreter) and for the GPU fidelity check of bench/depth.py (the
compiled kernel).

Each case fills a KV pool of one layer with random K/V (shuffled cells, so a slot's positions are scattered over the
pool as they are after resets), writes query rows, and compares `kernel` with `reference` per row and head. The
cells no sequence holds are filled with NaN (values, and q8_0's scales), as stale memory may be: a kernel that reads
one of them, even to multiply it by zero, fails the case.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from strata.gguf.model import CacheType
from strata.stage_worker.kernels.paged_attention import AttentionRule, Sequences, attend_fresh, kernel, reference
from strata.stage_worker.kv_pool import KVPool

if TYPE_CHECKING:
    from strata.stage_worker.kernels.paged_attention_triton import LaunchConfig

ALL_CACHE_TYPES = (CacheType.Q8_0, CacheType.F16, CacheType.BF16, CacheType.F32)


@dataclass(frozen=True)
class AttentionCase:
    name: str
    kv_lens: tuple[int, ...]  # per sequence
    q_lens: tuple[int, ...] | None = None  # None: one row each (a decode step)
    n_head: int = 8
    n_head_kv: int = 2
    head_dim: int = 64
    cache: CacheType = CacheType.Q8_0
    # K/V magnitude (large ones stay inside f16's range, as K/V computed in f16 do); q is divided by a large one, so
    # the case tests the storage and the sums, not a one-hot softmax
    scale: float = 1.0
    zero_cells: bool = False  # every other sequence's K/V all zeros (q8_0 blocks with zero scales)
    window: int = 0  # sliding-window attention over this many positions (Gemma); 0: none
    softcap: float = 0.0  # scores soft-capped at this (Gemma 2); 0: not
    gpu_only: bool = False  # too slow for the interpreter
    fresh: bool = False  # one prompt from position 0, attended by `attend_fresh` (flash attention) instead

    @property
    def rows(self) -> tuple[int, ...]:
        return self.q_lens or tuple(1 for _ in self.kv_lens)


def _mixed(batch: int, top: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(batch * 7919 + top)
    return tuple(int(x) for x in torch.randint(1, top + 1, (batch,), generator=g))


def _fresh(name: str, length: int, **fields: Any) -> AttentionCase:
    """One prompt of `length` positions from position 0, attended by `attend_fresh`."""
    return AttentionCase(name, kv_lens=(length,), q_lens=(length,), fresh=True, **fields)


CASES = [
    AttentionCase("one stream, one position", kv_lens=(1,)),
    AttentionCase("one stream, 300 positions", kv_lens=(300,)),
    AttentionCase("lengths around a tile edge", kv_lens=(63, 64, 65, 127, 128, 129)),
    AttentionCase("batch of 16, mixed lengths", kv_lens=_mixed(16, 700)),
    AttentionCase("no GQA (1 query head per KV head)", kv_lens=(200, 9), n_head=4, n_head_kv=4),
    AttentionCase("GQA 3 (not a power of two)", kv_lens=(150, 2), n_head=6, n_head_kv=2),
    AttentionCase("GQA 8", kv_lens=(250,), n_head=8, n_head_kv=1),
    AttentionCase("head dim 128", kv_lens=(90, 400), n_head=4, n_head_kv=2, head_dim=128),
    AttentionCase("head dim 256", kv_lens=(90, 300), n_head=4, n_head_kv=1, head_dim=256),
    AttentionCase("head dim 48 (heads not on q8_0 block edges)", kv_lens=(77, 5), n_head=4, n_head_kv=2, head_dim=48),
    *(AttentionCase(f"{c.value} cache", kv_lens=(5, 333), cache=c) for c in ALL_CACHE_TYPES),
    AttentionCase("extreme values, q8_0", kv_lens=(200,), scale=1.0e4),
    AttentionCase("extreme values, f16", kv_lens=(200,), scale=1.0e4, cache=CacheType.F16),
    AttentionCase("tiny values, q8_0 (subnormal f16 scales)", kv_lens=(200,), scale=1.0e-3),
    AttentionCase("all-zero blocks", kv_lens=(100, 100, 64), zero_cells=True),
    AttentionCase("chunks after cached positions", kv_lens=(300, 80), q_lens=(45, 80)),
    AttentionCase("a chunk of 3 positions (a speculative step)", kv_lens=(500, 20), q_lens=(3, 3)),
    AttentionCase("a window of 100 over decode rows", kv_lens=(300, 64, 100, 101), window=100),
    AttentionCase("a window of 32 over chunks after cached positions", kv_lens=(300, 80), q_lens=(45, 80), window=32),
    AttentionCase("scores capped at 1, so the cap binds", kv_lens=(200, 7), q_lens=(3, 1), scale=3.0, softcap=1.0),
    AttentionCase("window and cap, head dim 256", kv_lens=(150,), q_lens=(20,), window=64, softcap=2.0, head_dim=256),
    *(
        _fresh(f"a fresh prompt through flash attention, {c.value} cache", 1100, head_dim=128, cache=c)
        for c in ALL_CACHE_TYPES
    ),
    _fresh("a fresh prompt, no GQA, extreme values", 1030, n_head=4, n_head_kv=4, scale=1.0e4),
    AttentionCase("long stream beyond 64K", kv_lens=(70_000,), n_head=4, n_head_kv=1),
    AttentionCase("128K, Llama-3-8B heads", kv_lens=(131_072,), n_head=32, n_head_kv=8, head_dim=128, gpu_only=True),
    AttentionCase(
        "64 streams at mixed depth", kv_lens=_mixed(64, 8192), n_head=32, n_head_kv=8, head_dim=128, gpu_only=True
    ),
    AttentionCase(
        "long chunk after a long prefix",
        kv_lens=(20_000,),
        q_lens=(1_000,),
        n_head=32,
        n_head_kv=8,
        head_dim=128,
        gpu_only=True,
    ),
]

# The cases LaunchConfig.int8_scores takes (q8_0 K of 128-value heads): every q8_0 case of the table but the fresh
# prompts (flash attention), at that head size.
INT8_CASES = [
    c if c.head_dim == 128 else replace(c, name=f"{c.name}, heads of 128", head_dim=128)
    for c in CASES
    if c.cache is CacheType.Q8_0 and not c.fresh
]


def relative_error(ours: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest relative L2 error over rows and heads."""
    diff = (ours.float() - expected.float()).norm(dim=-1)
    return float((diff / expected.float().norm(dim=-1).clamp_min(1e-30)).max())


def run_case(
    case: AttentionCase,
    *,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
    launch: LaunchConfig | None = None,
    reference_q: Callable[[torch.Tensor, float], torch.Tensor] | None = None,
) -> float:
    """Kernel against reference on fresh random inputs; returns the largest relative error (NaN fails any bound).
    `launch`: the Triton kernel under that launch configuration, called directly (not through the model's op);
    `reference_q`: what the reference attends with instead of q (q and the scores' scale in; round_q_int8, say)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    width = case.n_head_kv * case.head_dim
    cells = sum(case.kv_lens) + 7
    pool = KVPool(
        n_layers=1, context=cells, parallel=len(case.kv_lens), key_width=width, value_width=width,
        type_k=case.cache, type_v=case.cache, dtype=dtype, device=device,
    )  # fmt: skip
    # A table as wide as the longest sequence would do; the pool's own is [parallel, context].
    order = torch.randperm(cells, generator=g)
    taken = 0
    for slot, length in enumerate(case.kv_lens):
        slot_cells = order[taken : taken + length]
        taken += length
        pool.table[slot, :length] = slot_cells.to(device)
        magnitude = 0.0 if case.zero_cells and slot % 2 == 0 else case.scale
        k = torch.randn(length, width, generator=g) * magnitude
        v = torch.randn(length, width, generator=g) * magnitude
        pool.layers[0].write(slot_cells.to(device), k.to(device), v.to(device))
    spare = order[taken:].to(device)  # cells in no table
    for store in (pool.layers[0].keys, pool.layers[0].values):
        store.values[spare] = 0 if store.scales is not None else float("nan")
        if store.scales is not None:
            store.scales[spare] = float("nan")
    rows = case.rows
    q = torch.randn(sum(rows), case.n_head, case.head_dim, generator=g) / max(case.scale, 1.0)
    q = q.to(device=device, dtype=dtype)
    starts = [sum(rows[:i]) for i in range(len(rows))]
    sequences = Sequences(
        slots=torch.arange(len(rows), device=device),
        q_starts=torch.tensor(starts, device=device),
        q_lens=torch.tensor(rows, device=device),
        kv_lens=torch.tensor(case.kv_lens, device=device),
        max_q_len=max(rows),
    )
    rule = AttentionRule(scale=case.head_dim**-0.5, window=case.window, softcap=case.softcap)
    args = {"table": pool.table, "sequences": sequences, "n_head_kv": case.n_head_kv, "rule": rule}
    exact_q = q if reference_q is None else reference_q(q, rule.scale)
    expected = reference(exact_q, pool.layers[0], **args)  # type: ignore[arg-type]
    if case.fresh:
        prompt_cells = pool.table[0, : case.kv_lens[0]]
        ours = attend_fresh(q, pool.layers[0], cells=prompt_cells, n_head_kv=case.n_head_kv, rule=rule)
    elif launch is not None:
        from strata.stage_worker.kernels.paged_attention_triton import paged_attention  # Triton, only when asked

        cache = pool.layers[0]
        ours = paged_attention(
            q.contiguous(), keys=cache.keys.values, key_scales=cache.keys.scales, values=cache.values.values,
            value_scales=cache.values.scales, table=pool.table, slots=sequences.slots, q_starts=sequences.q_starts,
            q_lens=sequences.q_lens, kv_lens=sequences.kv_lens, max_q_len=sequences.max_q_len,
            n_head_kv=case.n_head_kv, scale=rule.scale, window=rule.window, softcap=rule.softcap, config=launch,
        )  # fmt: skip
    else:
        ours = kernel(q, pool.layers[0], **args)  # type: ignore[arg-type]
    return relative_error(ours, expected)


def tolerance(dtype: torch.dtype) -> float:
    """Within the compute dtype's accumulation error: both sides read the same dequantised K/V; the kernel rounds
    q, the probabilities and the K/V tiles to the compute dtype before its dot products, as flash attention does."""
    return {torch.float32: 1e-4, torch.float16: 5e-3}.get(dtype, 2e-2)
