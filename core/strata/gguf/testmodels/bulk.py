"""Models of real size with random weights, written as raw Q8_0 blocks: an 8B-parameter file in seconds.

Benchmarks on GPUs need a model of real shape, and no weights can be downloaded. Quantising 8 billion float32 values
through gguf-py's numpy quantiser takes far too long, so this writer skips the float values altogether: each Q8_0
block is 32 random int8 values and one f16 scale drawn near the scale a 0.02-wide weight would have. The header is
the same as the test models' (tokenizer, chat template, llama.cpp keys), so every reader treats the file as real.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import BinaryIO

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from strata.gguf.testmodels.shapes import ModelShape, PlannedTensor, tensor_plan
from strata.gguf.testmodels.vocabulary import vocabulary
from strata.gguf.testmodels.writer import ALIGNMENT, WrittenModel, WrittenTensor, _writer

Q8 = GGMLQuantizationType.Q8_0
F32 = GGMLQuantizationType.F32
WEIGHT_STD = 0.02
INT8_STD = 73.9  # standard deviation of uniform bytes read as int8 (-128..127)
PIECE_BLOCKS = 1 << 22  # blocks generated at a time (~143 MB), so memory stays flat


def bulk_plan(shape: ModelShape, *, vocab_size: int) -> list[PlannedTensor]:
    """The shape's tensors with every matrix in Q8_0 and the norms in F32."""
    return [
        dataclasses.replace(t, ggml_type=F32 if t.ggml_type is F32 else Q8)
        for t in tensor_plan(dataclasses.replace(shape, quantised=False), vocab_size=vocab_size)
    ]


def write_bulk_q8_model(path: Path, *, shape: ModelShape, seed: int = 0) -> WrittenModel:
    """A full-size file of `shape` (e.g. LARGE_SHAPES["llama3-8b"]) with random Q8_0 matrices and F32 norms."""
    shape = dataclasses.replace(shape, quantised=False)
    vocab = vocabulary(size=shape.vocab_size)
    plan = bulk_plan(shape, vocab_size=len(vocab.tokens))
    writer = _writer(path, shape=shape, vocab=vocab)
    written = []
    for planned in plan:
        block_elements, block_bytes = GGML_QUANT_SIZES[planned.ggml_type]
        nbytes = int(np.prod(planned.dims)) // block_elements * block_bytes
        writer.add_tensor_info(
            planned.name, tuple(reversed(planned.dims)), np.dtype(np.float32), nbytes, raw_dtype=planned.ggml_type
        )
        written.append(WrittenTensor(name=planned.name, dims=planned.dims, ggml_type=planned.ggml_type, nbytes=nbytes))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    rng = np.random.default_rng(seed)
    with path.open("ab") as file:
        _pad(file)
        for planned, tensor in zip(plan, written, strict=True):
            if planned.ggml_type is F32:
                values = 1.0 + 0.1 * rng.standard_normal(int(np.prod(planned.dims)), dtype=np.float32)
                file.write(values.tobytes())
            else:
                _write_q8_blocks(file, blocks=tensor.nbytes // 34, rng=rng)
            _pad(file)
    return WrittenModel(
        path=path, shape=shape, vocab_size=len(vocab.tokens), tensors=tuple(written), header_only=False, seed=seed
    )


def _write_q8_blocks(file: BinaryIO, *, blocks: int, rng: np.random.Generator) -> None:
    scale = WEIGHT_STD / INT8_STD
    for start in range(0, blocks, PIECE_BLOCKS):
        n = min(PIECE_BLOCKS, blocks - start)
        piece = np.empty((n, 34), dtype=np.uint8)
        # 64-bit integers are drawn several times faster than rng.bytes(); their bytes are as uniform.
        draws = rng.integers(-(1 << 63), (1 << 63) - 1, size=n * 4, dtype=np.int64, endpoint=True)
        piece[:, 2:] = draws.view(np.uint8).reshape(n, 32)
        scales = (scale * rng.uniform(0.75, 1.25, size=n)).astype(np.float16)
        piece[:, :2] = scales.view(np.uint8).reshape(n, 2)
        file.write(piece.data)


def _pad(file: BinaryIO) -> None:
    position = file.tell()
    file.write(b"\0" * (-position % ALIGNMENT))
