"""The q8_0 KV write kernel against the pool's own quantiser (strata.stage_worker.kv_stores.quantise_q8), bit for bit:
the int8 values and f16 scales a step writes decide every later attention score, so the GPU must store what the CPU
reference stores. Without a GPU the kernel runs under Triton's interpreter."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from strata.stage_worker.kernels.kv_write import write_q8_kv
from strata.stage_worker.kv_stores import quantise_q8
from torch import Tensor

CELLS = 40


def _normal(n: int, width: int, g: torch.Generator) -> Tensor:
    return torch.randn(n, width, generator=g)


def _extremes(n: int, width: int, g: torch.Generator) -> Tensor:
    """Huge (to f32's limit: the f16 scale overflows), tiny and ordinary values in every block, a block of zeros, and
    a block of evenly spaced values."""
    x = torch.randn(n, width, generator=g).clamp(-1, 1) * torch.tensor([1e4, 1e-30, 1.0, 3e38])[torch.arange(width) % 4]
    x[:, :32] = 0.0
    x[:, 32:64] = torch.arange(32) - 15.5
    return x


def _ties(n: int, width: int, g: torch.Generator) -> Tensor:
    """Blocks whose max is 127, so d = 1 and every x.5 is a tie (ties go to even, as torch.round does)."""
    x = (torch.randint(-254, 255, (n, width), generator=g).float()) / 2
    x[:, ::32] = 127.0
    return x


@dataclass(frozen=True)
class Case:
    name: str
    rows: int
    width: int
    values: Callable[[int, int, torch.Generator], Tensor]
    dtype: torch.dtype = torch.float32
    strided_v: bool = False  # v a column slice of a wider tensor, as the model's fused qkv output gives it


CASES = [
    Case("one row", 1, 1024, _normal),
    Case("a prefill chunk", 17, 256, _normal),
    Case("f16 rows", 5, 256, _normal, dtype=torch.float16),
    Case("three blocks a row (not a power of two)", 6, 96, _normal),
    Case("extreme values and a zero block", 4, 256, _extremes),
    Case("ties to even", 4, 128, _ties),
    Case("v a slice of the qkv output", 3, 128, _normal, strided_v=True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_kernel_stores_what_the_reference_stores(case: Case, device: torch.device) -> None:
    g = torch.Generator().manual_seed(7)
    k = case.values(case.rows, case.width, g).to(case.dtype)
    v_wide = case.values(case.rows, 3 * case.width, g).to(case.dtype)
    v = v_wide[:, case.width : 2 * case.width] if case.strided_v else v_wide[:, : case.width].contiguous()
    cells = torch.randperm(CELLS, generator=g)[: case.rows]
    stores = {
        name: torch.zeros(CELLS, case.width // (32 if "scales" in name else 1), dtype=dtype, device=device)
        for name, dtype in (("k_values", torch.int8), ("k_scales", torch.float16), ("v_values", torch.int8),
                            ("v_scales", torch.float16))
    }  # fmt: skip
    write_q8_kv(k=k.to(device), v=v.to(device), cells=cells.to(device), **stores)

    for rows, prefix in ((k, "k"), (v, "v")):
        values, scales = quantise_q8(rows)
        expected_values = torch.zeros(CELLS, case.width, dtype=torch.int8)
        expected_scales = torch.zeros(CELLS, case.width // 32, dtype=torch.float16)
        expected_values[cells], expected_scales[cells] = values, scales
        assert torch.equal(stores[f"{prefix}_values"].cpu(), expected_values), f"{prefix} values differ"
        assert torch.equal(stores[f"{prefix}_scales"].cpu(), expected_scales), f"{prefix} scales differ"


def test_rows_of_the_wrong_width_are_refused_by_name() -> None:
    stores = {
        "k_values": torch.zeros(4, 64, dtype=torch.int8), "k_scales": torch.zeros(4, 2, dtype=torch.float16),
        "v_values": torch.zeros(4, 64, dtype=torch.int8), "v_scales": torch.zeros(4, 2, dtype=torch.float16),
    }  # fmt: skip
    with pytest.raises(ValueError, match=r"v rows must be \[N, 64\]"):
        write_q8_kv(k=torch.zeros(2, 64), v=torch.zeros(2, 32), cells=torch.tensor([0, 1]), **stores)
