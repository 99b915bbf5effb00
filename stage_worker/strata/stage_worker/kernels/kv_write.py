"""A step's K and V into the pool on a GPU: the Triton kernels of strata.stage_worker.kernels.kv_write_triton as
torch custom ops, so that torch.compile keeps them whole inside a compiled block (they mutate the stores in place,
and a CUDA graph replays them). `rotate_and_write` is what the model calls: q and k rotated by RoPE and k and v
written in one launch on a GPU; elsewhere, and as the kernel's test oracle, Rope.apply and the pool's own writes
(strata.stage_worker.kv_stores.quantise_q8 for q8_0).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from strata.gguf.architectures import RopeStyle
from strata.stage_worker.kv_stores import LayerCache
from strata.stage_worker.rope import Rope
from torch import Tensor


@torch.library.custom_op("strata::write_q8_kv", mutates_args=("k_values", "k_scales", "v_values", "v_scales"))
def _write_q8_kv_op(
    k: Tensor, v: Tensor, cells: Tensor, k_values: Tensor, k_scales: Tensor, v_values: Tensor, v_scales: Tensor
) -> None:
    from strata.stage_worker.kernels.kv_write_triton import write_q8

    # Triton launches on the current device's stream, whatever the tensors say (under its interpreter, on the CPU).
    with torch.cuda.device(k.device) if k.device.type == "cuda" else nullcontext():
        write_q8(k=k, v=v, cells=cells, k_values=k_values, k_scales=k_scales, v_values=v_values, v_scales=v_scales)


def write_q8_kv(
    *, k: Tensor, v: Tensor, cells: Tensor, k_values: Tensor, k_scales: Tensor, v_values: Tensor, v_scales: Tensor
) -> None:
    """Rows of k and v [N, width] into cells [N] of two q8_0 stores, in one launch (on the CPU under Triton's
    interpreter: the tests' way in). Rows are made dense along the width, which the kernel walks."""
    for name, rows, store in (("k", k, k_values), ("v", v, v_values)):
        if rows.dim() != 2 or rows.shape[1] != store.shape[1]:
            raise ValueError(f"{name} rows must be [N, {store.shape[1]}], not {tuple(rows.shape)}")
    _write_q8_kv_op(
        k if k.stride(-1) == 1 else k.contiguous(), v if v.stride(-1) == 1 else v.contiguous(), cells,
        k_values, k_scales, v_values, v_scales,
    )  # fmt: skip


@torch.library.custom_op("strata::rope_write_kv", mutates_args=("k_values", "k_scales", "v_values", "v_scales"))
def _rope_write_op(
    q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, cells: Tensor, k_values: Tensor,
    k_scales: Tensor | None, v_values: Tensor, v_scales: Tensor | None, head_dim: int, rope_dim: int, neox: bool,
) -> Tensor:  # fmt: skip
    from strata.stage_worker.kernels.kv_write_triton import rope_write

    with torch.cuda.device(q.device) if q.device.type == "cuda" else nullcontext():
        return rope_write(
            q=q, k=k, v=v, cos=cos, sin=sin, cells=cells, k_values=k_values, k_scales=k_scales, v_values=v_values,
            v_scales=v_scales, head_dim=head_dim, rope_dim=rope_dim, neox=neox,
        )  # fmt: skip


@_rope_write_op.register_fake
def _(q: Tensor, *args: object) -> Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def rope_write_kv(*, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, cells: Tensor, cache: LayerCache,
                  rope: Rope) -> Tensor:  # fmt: skip
    """The kernel: q [N, H, hd], k and v [N, Hkv, hd], cos and sin as Rope.angles gives them ([N, 1, rope_dim / 2])
    -> q rotated [N, H, hd]; k rotated and v written into cells [N] of the layer's stores (on the CPU under Triton's
    interpreter: the tests' way in)."""
    n, heads, head_dim = q.shape
    rows = [x.reshape(n, -1) for x in (q, k, v)]  # a view where the heads are dense, as the qkv projection gives them
    q_rows, k_rows, v_rows = (x if x.stride(-1) == 1 else x.contiguous() for x in rows)
    keys, values = cache.keys, cache.values
    rotated: Tensor = _rope_write_op(
        q_rows, k_rows, v_rows, cos.reshape(n, -1).contiguous(), sin.reshape(n, -1).contiguous(), cells,
        keys.values, keys.scales, values.values, values.scales, head_dim, rope.rope_dim, rope.style is RopeStyle.NEOX,
    )  # fmt: skip
    return rotated.view(n, heads, head_dim)


def rotate_and_write(*, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, cells: Tensor, cache: LayerCache,
                     rope: Rope) -> Tensor:  # fmt: skip
    """q and k rotated by RoPE, k and v into cells of the layer's cache; returns q rotated. One kernel on a GPU."""
    if q.device.type == "cuda":
        return rope_write_kv(q=q, k=k, v=v, cos=cos, sin=sin, cells=cells, cache=cache, rope=rope)
    n = q.shape[0]
    q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
    cache.write(cells, k.reshape(n, -1), v.reshape(n, -1))
    return q
