"""The KV pool: one unified pool of `context` cells that the `parallel` slots share, in the planned cache type.

As in llama.cpp's unified KV cache, lanes do not multiply KV memory: a slot takes cells from the free list as its
sequence grows and gives them back on reset. The planner sized the pool with ModelInfo.kv_bytes(); the stores here
allocate the same bytes (q8_0: int8 values plus one f16 scale per block of 32, ggml's block_q8_0 split into two
arrays) and dequantise to the compute dtype when attention reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from strata.gguf.model import CacheType
from strata.stage_worker.errors import ContextExceededError, PoolExhaustedError, UnknownSlotError
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
        return RawRows(values=self.values[:rows], scales=None if self.scales is None else self.scales[:rows])


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

    def put(self, cells: Tensor, rows: RawRows) -> None:
        self.values[cells] = rows.values
        if self.scales is not None and rows.scales is not None:
            self.scales[cells] = rows.scales

    def write(self, cells: Tensor, rows: Tensor) -> None:
        # cells: [N], rows: [N, width]
        if self.scales is None:
            self.values[cells] = rows.to(self.values.dtype)
            return
        blocks = rows.float().view(rows.shape[0], -1, Q8_BLOCK)  # [N, width / 32, 32]
        scale = blocks.abs().amax(dim=-1) / 127.0  # [N, width / 32]
        scale16 = scale.to(torch.float16)
        inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        quantised = torch.round(blocks * inverse[..., None]).clamp(-127, 127).to(torch.int8)
        self.values[cells] = quantised.view(rows.shape[0], -1)
        self.scales[cells] = scale16

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

    def write(self, cells: Tensor, k: Tensor, v: Tensor) -> None:
        self.keys.write(cells, k)
        self.values.write(cells, v)

    def read(self, cells: Tensor) -> tuple[Tensor, Tensor]:
        return self.keys.read(cells, dtype=self.dtype), self.values.read(cells, dtype=self.dtype)


class KVPool:
    """`context` cells per layer, shared by `parallel` slots; each slot holds its cells in position order."""

    def __init__(
        self,
        *,
        n_layers: int,
        context: int,
        parallel: int,
        key_width: int,
        value_width: int,
        type_k: CacheType,
        type_v: CacheType,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.context = context
        self.parallel = parallel
        self.device = device
        self.layers = [
            LayerCache(
                keys=Store(cache_type=type_k, cells=context, width=key_width, device=device),
                values=Store(cache_type=type_v, cells=context, width=value_width, device=device),
                dtype=dtype,
            )
            for _ in range(n_layers)
        ]
        self._free: list[int] = list(range(context - 1, -1, -1))  # a stack: pop() hands out low cells first
        self._slots: list[list[int]] = [[] for _ in range(parallel)]
        # The same cells on the device, row = slot, column = position: batched decode reads a slot's cells from
        # here (table[slots, :S]) without copying the host lists over every step. Columns past a slot's length are
        # stale and are masked by position. Decode steps write their new cell into it on the device themselves.
        self.table = torch.zeros(parallel, context, dtype=torch.long, device=device)

    @property
    def nbytes(self) -> int:
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers)

    @property
    def cell_bytes(self) -> int:
        """Bytes of one position over every layer this pool holds, K and V, as stored."""
        return sum(layer.keys.row_bytes + layer.values.row_bytes for layer in self.layers)

    @property
    def free_cells(self) -> int:
        return len(self._free)

    def length(self, slot: int) -> int:
        return len(self._slot(slot))

    def check(self, *, slot: int, start_position: int, length: int) -> None:
        """Refuse a chunk that names an unknown slot, leaves a gap, or runs past the context."""
        cells = self._slot(slot)
        if start_position > len(cells):
            raise ContextExceededError(
                f"slot {slot} holds {len(cells)} positions; a chunk cannot start at position {start_position}"
            )
        if start_position + length > self.context:
            raise ContextExceededError(
                f"positions {start_position}..{start_position + length - 1} of slot {slot} exceed the context "
                f"of {self.context}"
            )

    def extend(self, *, slot: int, start_position: int, length: int) -> tuple[Tensor, Tensor]:
        """Truncate the slot to `start_position`, take `length` cells; return (new cells, all cells in order)."""
        self.check(slot=slot, start_position=start_position, length=length)
        cells = self._slot(slot)
        self._free.extend(reversed(cells[start_position:]))
        del cells[start_position:]
        if length > len(self._free):
            raise PoolExhaustedError(
                f"slot {slot} needs {length} KV cells but only {len(self._free)} of {self.context} are free"
            )
        new = [self._free.pop() for _ in range(length)]
        cells.extend(new)
        as_tensor = torch.tensor(cells, dtype=torch.long, device=self.device)
        self.table[slot, start_position : start_position + length] = as_tensor[start_position:]
        return as_tensor[start_position:], as_tensor

    def take(self, *, slot: int, position: int) -> int:
        """A decode step's one new cell for `slot` at `position`, on the host only: the step puts it in the table."""
        self.check(slot=slot, start_position=position, length=1)
        cells = self._slot(slot)
        self._free.extend(reversed(cells[position:]))
        del cells[position:]
        if not self._free:
            raise PoolExhaustedError(f"slot {slot} needs 1 KV cell but none of {self.context} are free")
        cell = self._free.pop()
        cells.append(cell)
        return cell

    def prefix_cells(self, *, slot: int, length: int) -> Tensor:
        """The cells of positions 0..length-1 of `slot`, which must hold at least that many."""
        cells = self._slot(slot)
        if not 1 <= length <= len(cells):
            raise ContextExceededError(f"slot {slot} holds {len(cells)} positions; a prefix of {length} is not there")
        return torch.tensor(cells[:length], dtype=torch.long, device=self.device)

    def reset(self, slot: int) -> None:
        cells = self._slot(slot)
        self._free.extend(reversed(cells))
        cells.clear()

    def _slot(self, slot: int) -> list[int]:
        if not 0 <= slot < self.parallel:
            raise UnknownSlotError(f"slot {slot} does not exist; this stage has slots 0..{self.parallel - 1}")
        return self._slots[slot]
