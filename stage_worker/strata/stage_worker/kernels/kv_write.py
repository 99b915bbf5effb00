"""A step's K and V into a q8_0 pool on a GPU: the Triton kernel of strata.stage_worker.kernels.kv_write_triton as a
torch custom op, so that torch.compile keeps it whole inside a compiled block (it mutates the stores in place, and
a CUDA graph replays it). The pool's own quantiser (strata.stage_worker.kv_pool.quantise_q8) is its reference and
the CPU's path.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
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
