"""A q8_0 store's rows read back in one launch (strata.stage_worker.kernels.kv_read_triton): bit for bit what
kv_stores.Store.read gives, on the CPU under Triton's interpreter and on a GPU compiled, for cells in any order,
widths of one block and of a Llama head group, zero blocks and the largest scales."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from strata.gguf.model import CacheType
from strata.stage_worker.kernels.kv_read_triton import read_q8
from strata.stage_worker.kv_stores import Store

from tests.stage_worker.test_quant_matmul import dtypes


@dataclass(frozen=True)
class Case:
    name: str
    width: int
    cells: tuple[int, ...]
    scale: float = 0.02  # of the rows written
    zero_cells: tuple[int, ...] = ()
    largest: bool = False  # put f16's largest finite scale in every block of cell 0


CASES = [
    Case("one block a row, cells in order", 32, (0, 1, 2, 3)),
    Case("Llama's 8 KV heads of 128, cells out of order", 1024, (5, 0, 7, 3, 3)),
    Case("a width of three blocks", 96, (2, 4, 1)),
    Case("zero blocks", 64, (0, 1, 2), zero_cells=(1,)),
    Case("the largest scales", 64, (0, 2), largest=True),
]


@pytest.mark.parametrize(
    ("case", "dtype"),
    [pytest.param(c, d, id=f"{c.name}-{str(d).removeprefix('torch.')}") for c in CASES for d in dtypes()],
)
def test_read_matches_the_store(case: Case, dtype: torch.dtype, device: torch.device) -> None:
    store = Store(cache_type=CacheType.Q8_0, cells=8, width=case.width, device=torch.device("cpu"))
    rows = torch.randn(8, case.width, generator=torch.Generator().manual_seed(case.width)) * case.scale
    for cell in case.zero_cells:
        rows[cell] = 0
    store.write(torch.arange(8), rows)
    if case.largest:
        assert store.scales is not None
        store.scales[0] = torch.finfo(torch.float16).max
    cells = torch.tensor(case.cells, dtype=torch.long)
    want = store.read(cells, dtype=dtype)
    assert store.scales is not None
    got = read_q8(store.values.to(device), store.scales.to(device), cells.to(device), dtype).cpu()
    assert got.shape == (len(case.cells), case.width)
    assert torch.equal(got, want), f"differs from Store.read by up to {(got.float() - want.float()).abs().max()}"
    for cell in case.zero_cells:
        assert not got[list(case.cells).index(cell)].any()


def test_strided_rows_are_refused(device: torch.device) -> None:
    values = torch.zeros(64, 4, dtype=torch.int8, device=device).t()
    scales = torch.zeros(4, 2, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="columns are dense"):
        read_q8(values, scales, torch.zeros(1, dtype=torch.long, device=device), torch.float32)


def test_warm_reads_compile_nothing_off_a_gpu() -> None:
    """warm_steps.warm_reads compiles the read-back kernel on a GPU with a q8_0 pool; elsewhere it runs nothing."""
    from strata.stage_worker.kv_pool import KVPool
    from strata.stage_worker.warm_steps import warm_reads

    pool = KVPool(
        n_layers=1, context=64, parallel=1, key_width=64, value_width=64, type_k=CacheType.Q8_0,
        type_v=CacheType.Q8_0, dtype=torch.float32, device=torch.device("cpu"),
    )  # fmt: skip
    assert warm_reads(pool) is False
