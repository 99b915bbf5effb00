"""The planes a stage keeps for each GGUF block type hold exactly the values gguf-py reads from the file's bytes.

Random bytes exercise every bit of every field (scales of any magnitude, NaN and infinite f16 scales included, zero
and negative minimums); real quantised blocks check the common case. Equality is bitwise: the reference is the
function the CPU computes and the function GPU kernels are checked against.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize
from strata.gguf.resident import resident_bytes
from strata.stage_worker.weights.formats import FORMATS, dequantize, plane_names, planes_bytes, split_planes

Q = GGMLQuantizationType
QUANTISABLE = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)  # gguf-py quantises these; the K-quants it only reads


@dataclass(frozen=True)
class Blocks:
    name: str
    make: str  # "random" bytes, "quantised" normal values, "zero" bytes, "extreme" scales


CASES = [Blocks("random bytes", "random"), Blocks("zero blocks", "zero"), Blocks("extreme scales", "extreme")]


def _bytes(ggml_type: GGMLQuantizationType, rows: int, columns: int, make: str, rng: np.random.Generator) -> np.ndarray:
    elements, size = GGML_QUANT_SIZES[ggml_type]
    shape = (rows, columns // elements * size)
    if make == "zero":
        return np.zeros(shape, dtype=np.uint8)
    raw = rng.integers(0, 256, size=shape, dtype=np.uint8)
    if make == "extreme":  # every f16 field at the largest finite magnitude, either sign
        blocks = raw.reshape(rows, -1, size)
        for field in FORMATS[ggml_type].fields:
            if field.dtype == torch.float16:
                value = np.where(rng.random(blocks.shape[:2]) < 0.5, 65504.0, -65504.0).astype(np.float16)
                blocks[:, :, field.offset : field.offset + 2] = value.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return raw


def _check(raw: np.ndarray, ggml_type: GGMLQuantizationType) -> None:
    expected = np.asarray(gguf_dequantize(raw, ggml_type), dtype=np.float32)
    planes = split_planes(torch.from_numpy(raw.copy()).reshape(-1), ggml_type, rows=raw.shape[0])
    got = dequantize(planes, ggml_type).numpy()
    assert got.shape == expected.shape
    assert np.array_equal(got, expected, equal_nan=True), f"{ggml_type.name}: values differ from gguf-py"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # gguf-py's own arithmetic on random NaN/inf scales
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("ggml_type", list(FORMATS), ids=lambda t: t.name)
def test_planes_hold_the_values_gguf_reads(ggml_type: GGMLQuantizationType, case: Blocks) -> None:
    rng = np.random.default_rng(int(ggml_type) * 31 + len(case.name))
    _check(_bytes(ggml_type, 3, 512, case.make, rng), ggml_type)


@pytest.mark.parametrize("ggml_type", QUANTISABLE, ids=lambda t: t.name)
def test_quantised_values_come_back(ggml_type: GGMLQuantizationType) -> None:
    values = np.random.default_rng(int(ggml_type)).standard_normal((4, 256)).astype(np.float32)
    _check(np.asarray(quantize(values, ggml_type)), ggml_type)


@pytest.mark.parametrize("ggml_type", list(FORMATS), ids=lambda t: t.name)
def test_planes_take_the_bytes_planning_counts(ggml_type: GGMLQuantizationType) -> None:
    raw = _bytes(ggml_type, 6, 1024, "random", np.random.default_rng(0))
    planes = split_planes(torch.from_numpy(raw).reshape(-1), ggml_type, rows=6)
    assert tuple(planes) == plane_names(ggml_type)
    counted = resident_bytes(ggml_type, name="blk.0.ffn_up.weight", elements=6 * 1024, stored_bytes=raw.nbytes)
    assert planes_bytes(planes) == counted
    assert counted <= 1.05 * raw.nbytes


def test_a_wrong_layout_is_caught() -> None:
    """The comparison can fail: Q4_0 read with its nibbles swapped differs from gguf-py."""
    raw = _bytes(Q.Q4_0, 2, 64, "random", np.random.default_rng(1))
    swapped = raw.reshape(2, -1, 18).copy()
    swapped[:, :, 2:] = (swapped[:, :, 2:] >> 4) | (swapped[:, :, 2:] << 4)
    planes = split_planes(torch.from_numpy(swapped).reshape(-1), Q.Q4_0, rows=2)
    expected = np.asarray(gguf_dequantize(raw, Q.Q4_0), dtype=np.float32)
    assert not np.array_equal(dequantize(planes, Q.Q4_0).numpy(), expected, equal_nan=True)
