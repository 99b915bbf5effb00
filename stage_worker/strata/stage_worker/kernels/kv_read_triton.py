"""A q8_0 store's rows at some cells, dequantised in one launch: what a long prompt's attention reads back of the K
and V it has just written (paged_attention.attend_fresh).

In torch the same read is a gather of the values and of the scales, each taken to f32, their product, and a rounding
copy: eight launches a layer over a 4,096-token prompt's 8 MB of K and V, and four times their bytes moved. Here a
program takes a cell's row: its int8 values and f16 scales read once, the product in f32 rounded once to the output's
dtype, as kv_stores.Store.read rounds it (bit for bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from strata.stage_worker.kv_stores import Q8_BLOCK
from torch import Tensor


@triton.jit
def _read_q8(values_ptr, scales_ptr, cells_ptr, out_ptr, blocks, stride_v, stride_s, stride_o,
             BLOCKS: tl.constexpr, Q8: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cell = tl.load(cells_ptr + row).to(tl.int64)
    block = tl.arange(0, BLOCKS)[:, None]
    offs = block * Q8 + tl.arange(0, Q8)[None, :]
    ok = block < blocks
    values = tl.load(values_ptr + cell * stride_v + offs, mask=ok, other=0).to(tl.float32)
    scales = tl.load(scales_ptr + cell * stride_s + block, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (values * scales).to(out_ptr.dtype.element_ty), mask=ok)


def read_q8(values: Tensor, scales: Tensor, cells: Tensor, dtype: torch.dtype) -> Tensor:
    """values [C, width] int8 and scales [C, width / 32] f16 of a store, cells [S] -> [S, width] in dtype."""
    if values.stride(1) != 1 or scales.stride(1) != 1:
        raise ValueError("read_q8 reads a store's rows whose columns are dense")
    blocks = scales.shape[1]
    out = torch.empty((cells.shape[0], blocks * Q8_BLOCK), dtype=dtype, device=values.device)
    if cells.shape[0] == 0:
        return out
    _read_q8[(cells.shape[0],)](
        values, scales, cells, out, blocks, values.stride(0), scales.stride(0), out.stride(0),
        BLOCKS=triton.next_power_of_2(blocks), Q8=Q8_BLOCK, num_warps=4,
    )  # fmt: skip
    return out
