"""A KV pool's stores: the rows of one layer's K or V in one cache type, and a layer's pair of them.

q8_0 rows are ggml's block_q8_0 split into two arrays: int8 values and one f16 scale per block of 32
(`quantise_q8`); attention reads them dequantised to the compute dtype. `RawRows` are rows exactly as stored, what a
prefix snapshot or the host tier moves so that a copy put back is bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from strata.gguf.model import CacheType
from torch import Tensor

Q8_BLOCK = 32

PLAIN_DTYPES: dict[CacheType, torch.dtype] = {
    CacheType.F32: torch.float32,
    CacheType.F16: torch.float16,
    CacheType.BF16: torch.bfloat16,
}


def _stored_bytes(values: Tensor, scales: Tensor | None) -> int:
    """Bytes of values and (q8_0) scales, as stored."""
    extra = 0 if scales is None else scales.numel() * scales.element_size()
    return values.numel() * values.element_size() + extra


def quantise_q8(rows: Tensor) -> tuple[Tensor, Tensor]:
    """rows [N, width] as ggml's block_q8_0 does it: per 32 values d = max|x| / 127 (f32, stored as f16) and the
    values round(x / d) as int8, through the f32 inverse of d. Returns (values [N, width] int8, scales [N, width / 32]
    f16)."""
    blocks = rows.float().view(rows.shape[0], -1, Q8_BLOCK)  # [N, width / 32, 32]
    scale = blocks.abs().amax(dim=-1) / 127.0  # [N, width / 32]
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    quantised = torch.round(blocks * inverse[..., None]).clamp(-127, 127).to(torch.int8)
    return quantised.view(rows.shape[0], -1), scale.to(torch.float16)


@dataclass(frozen=True)
class RawRows:
    """Rows of a store exactly as stored (q8_0: the int8 values and their f16 scales), so a copy put back is
    bit-identical to what the forward pass wrote."""

    values: Tensor  # [N, width]
    scales: Tensor | None  # [N, width / 32] for q8_0

    @property
    def nbytes(self) -> int:
        return _stored_bytes(self.values, self.scales)

    def head(self, rows: int) -> RawRows:
        return self.rows(0, rows)

    def rows(self, start: int, stop: int) -> RawRows:
        return RawRows(values=self.values[start:stop], scales=None if self.scales is None else self.scales[start:stop])


class Store:
    """`cells` rows of `width` values in one cache type."""

    def __init__(self, *, cache_type: CacheType, cells: int, width: int, device: torch.device) -> None:
        self.cache_type = cache_type
        if cache_type in PLAIN_DTYPES:
            self.values = torch.zeros(cells, width, dtype=PLAIN_DTYPES[cache_type], device=device)
            self.scales: Tensor | None = None
        elif cache_type is CacheType.Q8_0:
            if width % Q8_BLOCK:
                raise ValueError(f"q8_0 cache rows need a multiple of {Q8_BLOCK} values, not {width}")
            self.values = torch.zeros(cells, width, dtype=torch.int8, device=device)
            self.scales = torch.zeros(cells, width // Q8_BLOCK, dtype=torch.float16, device=device)
        else:
            raise ValueError(f"cache type {cache_type} is not supported by the stage worker (f32, f16, bf16, q8_0)")

    @property
    def nbytes(self) -> int:
        return _stored_bytes(self.values, self.scales)

    @property
    def row_bytes(self) -> int:
        return _stored_bytes(self.values[0], None if self.scales is None else self.scales[0])

    def raw(self, cells: Tensor) -> RawRows:
        """A copy of the rows at `cells` as stored (indexing with a tensor gathers into new memory)."""
        return RawRows(values=self.values[cells], scales=None if self.scales is None else self.scales[cells])

    def view(self, start: int, rows: int) -> RawRows:
        """Rows start..start+rows-1 in place (not a copy): what the host tier moves a block range through."""
        stop = start + rows
        return RawRows(values=self.values[start:stop], scales=None if self.scales is None else self.scales[start:stop])

    def put(self, cells: Tensor, rows: RawRows) -> None:
        self.values[cells] = rows.values
        if self.scales is not None and rows.scales is not None:
            self.scales[cells] = rows.scales

    def write(self, cells: Tensor, rows: Tensor) -> None:
        # cells: [N], rows: [N, width]
        if self.scales is None:
            self.values[cells] = rows.to(self.values.dtype)
            return
        self.values[cells], self.scales[cells] = quantise_q8(rows)

    def read(self, cells: Tensor, *, dtype: torch.dtype) -> Tensor:
        # cells: [S] -> [S, width] in dtype
        if self.scales is None:
            return self.values[cells].to(dtype)
        values = self.values[cells].view(cells.shape[0], -1, Q8_BLOCK).to(torch.float32)
        scales = self.scales[cells].to(torch.float32)[..., None]
        return (values * scales).view(cells.shape[0], -1).to(dtype)


class LayerCache:
    """The K and V stores of one layer."""

    def __init__(self, *, keys: Store, values: Store, dtype: torch.dtype) -> None:
        self.keys = keys
        self.values = values
        self.dtype = dtype
        # [parallel, H, hd]: each slot's query of its last one-row decode step, recorded by attention for the resident
        # window's choice (strata.stage_worker.kv_resident); None: not recorded.
        self.queries: Tensor | None = None

    def write(self, cells: Tensor, k: Tensor, v: Tensor) -> None:
        # cells: [N]; k, v: [N, width]
        keys, values = self.keys, self.values
        if k.device.type == "cuda" and keys.scales is not None and values.scales is not None:
            # Both q8_0 on a GPU: one kernel for the pair (strata.stage_worker.kernels.kv_write).
            from strata.stage_worker.kernels.kv_write import write_q8_kv

            write_q8_kv(
                k=k, v=v, cells=cells, k_values=keys.values, k_scales=keys.scales, v_values=values.values,
                v_scales=values.scales,
            )  # fmt: skip
            return
        keys.write(cells, k)
        values.write(cells, v)

    def read(self, cells: Tensor) -> tuple[Tensor, Tensor]:
        # cells: [S] -> K and V [S, width] each, in the layer's dtype
        return read_rows(self.keys, cells, self.dtype), read_rows(self.values, cells, self.dtype)


def read_rows(store: Store, cells: Tensor, dtype: torch.dtype) -> Tensor:
    """`Store.read`, and for a q8_0 store on a GPU the same rows bit for bit in one launch
    (strata.stage_worker.kernels.kv_read_triton), where torch's gather, dequantise and rounding take eight. Store.read
    stays the plain reference the kernel's tests compare with, as Store.write does for LayerCache.write's kernel."""
    if store.scales is None or not cells.is_cuda:
        return store.read(cells, dtype=dtype)
    from strata.stage_worker.kernels.kv_read_triton import read_q8

    with torch.cuda.device(cells.device):
        return read_q8(store.values, store.scales, cells, dtype)
