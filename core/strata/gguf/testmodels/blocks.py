"""Quantised blocks of any type a stage keeps, for test models: gguf-py's quantiser where it has one, and for the
K-quants (which gguf-py only reads) random blocks whose scales give values of a chosen spread.

A K-quant block's values are d x sc x q - dmin x m (Q4_K, Q5_K) or d x sc x q (Q6_K) with q, sc and m drawn
uniformly by the random bytes; d (and dmin, which centres the values) are set so the values' standard deviation is
about `std`, as a trained layer's would be. Random bits exercise every nibble, high bit and scale of the layout.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

Q = GGMLQuantizationType
# K-quant -> (standard deviation of sc x q in units of d, mean of q / mean of m for centring, where d sits in the block)
# sc and m are uniform on 0..63 (6 bits); Q4_K's q on 0..15, Q5_K's on 0..31; Q6_K's sc int8 on -16..16, q on -32..31.
_K_SPREAD = {Q.Q4_K: 218.0, Q.Q5_K: 443.0, Q.Q6_K: 176.0}
_K_CENTRE = {Q.Q4_K: 7.5, Q.Q5_K: 15.5}
K_QUANTS = frozenset(_K_SPREAD)


def random_blocks(
    ggml_type: GGMLQuantizationType, *, rows: int, columns: int, rng: np.random.Generator, std: float
) -> np.ndarray:
    """[rows, row bytes] uint8: `rows` x `columns` values of about `std` spread, stored as `ggml_type`."""
    if ggml_type not in _K_SPREAD:
        result: np.ndarray = quants.quantize(std * rng.standard_normal((rows, columns), dtype=np.float32), ggml_type)
        return result
    elements, size = GGML_QUANT_SIZES[ggml_type]
    if columns % elements:  # floor division would write rows of no blocks, and a file whose tensors are empty
        raise ValueError(f"{ggml_type.name} rows are whole blocks of {elements} values; {columns} columns are not")
    blocks = rng.integers(0, 256, size=(rows, columns // elements, size), dtype=np.uint8)
    d = (std / _K_SPREAD[ggml_type] * rng.uniform(0.75, 1.25, size=blocks.shape[:2])).astype(np.float16)
    if ggml_type is Q.Q6_K:
        blocks[:, :, 192:208] = rng.integers(-16, 17, size=(*blocks.shape[:2], 16), dtype=np.int8).view(np.uint8)
        blocks[:, :, 208:210] = d.view(np.uint8).reshape(*blocks.shape[:2], 2)
    else:
        dmin = (d.astype(np.float32) * _K_CENTRE[ggml_type]).astype(np.float16)
        blocks[:, :, 0:2] = d.view(np.uint8).reshape(*blocks.shape[:2], 2)
        blocks[:, :, 2:4] = dmin.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)
