"""Writing test models with gguf-py's GGUFWriter: deterministic from a seed, and described as they are written.

`write_test_model` writes a small executable model with real (random, seeded) weights quantised by gguf.quants;
`write_header_only_model` writes the header of a large model and no tensor data, which is what the planner needs.
Both return a WrittenModel listing each tensor's type, dimensions and byte size as the generator computed them, so
tests can derive expected figures without going through the reader they are testing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, LlamaFileType, quants
from strata.gguf.resident import resident_bytes
from strata.gguf.testmodels.blocks import K_QUANTS, random_blocks
from strata.gguf.testmodels.shapes import LARGE_SHAPES, SMALL_SHAPES, ModelShape, PlannedTensor, tensor_plan
from strata.gguf.testmodels.vocabulary import CHAT_TEMPLATE, Vocabulary, vocabulary

ALIGNMENT = 32  # GGUFWriter's default: the data section and every tensor start on a multiple of it
FLOAT_TYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}


@dataclass(frozen=True, kw_only=True)
class WrittenTensor:
    name: str
    dims: tuple[int, ...]  # ggml order
    ggml_type: GGMLQuantizationType
    nbytes: int

    @property
    def resident_bytes(self) -> int:
        """What a GPU stage holds for this tensor once loaded."""
        return resident_bytes(
            self.ggml_type, name=self.name, elements=int(np.prod(self.dims)), stored_bytes=self.nbytes
        )


@dataclass(frozen=True, kw_only=True)
class WrittenModel:
    path: Path
    shape: ModelShape
    vocab_size: int
    tensors: tuple[WrittenTensor, ...]
    header_only: bool
    seed: int | None = None

    def layer_bytes(self) -> list[int]:
        totals = [0] * self.shape.block_count
        for tensor in self.tensors:
            if tensor.name.startswith("blk."):
                totals[int(tensor.name.split(".")[1])] += tensor.nbytes
        return totals

    def layer_resident_bytes(self) -> list[int]:
        totals = [0] * self.shape.block_count
        for tensor in self.tensors:
            if tensor.name.startswith("blk."):
                totals[int(tensor.name.split(".")[1])] += tensor.resident_bytes
        return totals

    def tensor_bytes(self, name: str) -> int:
        return next(t.nbytes for t in self.tensors if t.name == name)

    def tensor_resident_bytes(self, name: str) -> int:
        return next(t.resident_bytes for t in self.tensors if t.name == name)


def write_test_model(
    path: Path,
    *,
    architecture: str,
    seed: int = 0,
    block_count: int | None = None,
    shape: ModelShape | None = None,
    weight_type: GGMLQuantizationType | None = None,
) -> WrittenModel:
    """A small model of `architecture` (a key of SMALL_SHAPES: llama, mixtral, qwen3moe, ...) with seeded weights, at
    `path`.

    `block_count` overrides the shape's layer count (the stage worker splits models into up to three stages);
    `shape` replaces the small shape outright (benchmarks want realistic widths); `weight_type` stores every matrix
    in that one type (norms stay F32), so each quantised type can be checked end to end.
    """
    shape = shape or SMALL_SHAPES[architecture]
    if block_count is not None:
        shape = dataclasses.replace(shape, block_count=block_count)
    vocab = vocabulary(size=shape.vocab_size)
    rng = np.random.default_rng(seed)
    writer = _writer(path, shape=shape, vocab=vocab)
    written = []
    for planned in tensor_plan(shape, vocab_size=len(vocab.tokens)):
        if weight_type is not None and planned.ggml_type is not GGMLQuantizationType.F32:
            planned = dataclasses.replace(planned, ggml_type=weight_type)
        data = _weights(planned, rng=rng) if planned.name != "rope_freqs.weight" else _rope_freqs(shape)
        writer.add_tensor(planned.name, data, raw_dtype=planned.ggml_type)
        written.append(_written(planned, nbytes=data.nbytes))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return WrittenModel(
        path=path, shape=shape, vocab_size=len(vocab.tokens), tensors=tuple(written), header_only=False, seed=seed
    )


def write_header_only_model(path: Path, *, shape: str | ModelShape, full_size: bool = False) -> WrittenModel:
    """The header of a large model (llama3-8b, llama3-70b, qwen3-30b-a3b, or any ModelShape), with no tensor data.

    With `full_size` the file is extended, sparsely (no disk used), to the size the real model would have, so HTTP
    tests and benchmarks read the header of a file as large as the real one.
    """
    model = LARGE_SHAPES[shape] if isinstance(shape, str) else shape
    vocab = vocabulary(size=model.vocab_size)
    writer = _writer(path, shape=model, vocab=vocab)
    written = []
    for planned in tensor_plan(model, vocab_size=len(vocab.tokens)):
        block_elements, block_bytes = GGML_QUANT_SIZES[planned.ggml_type]
        nbytes = int(np.prod(planned.dims)) // block_elements * block_bytes
        numpy_shape = tuple(reversed(planned.dims))
        writer.add_tensor_info(planned.name, numpy_shape, np.dtype(np.float32), nbytes, raw_dtype=planned.ggml_type)
        written.append(_written(planned, nbytes=nbytes))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    if full_size:
        data_start = -(-path.stat().st_size // ALIGNMENT) * ALIGNMENT
        with path.open("r+b") as file:
            file.truncate(data_start + sum(-(-t.nbytes // ALIGNMENT) * ALIGNMENT for t in written))
    return WrittenModel(path=path, shape=model, vocab_size=len(vocab.tokens), tensors=tuple(written), header_only=True)


def _written(planned: PlannedTensor, *, nbytes: int) -> WrittenTensor:
    return WrittenTensor(name=planned.name, dims=planned.dims, ggml_type=planned.ggml_type, nbytes=nbytes)


def _weights(planned: PlannedTensor, *, rng: np.random.Generator) -> np.ndarray:
    """Seeded values for one tensor, in its storage type: norms near 1, everything else small and centred."""
    numpy_shape = tuple(reversed(planned.dims))
    if planned.name.endswith("norm.weight"):
        values = 1.0 + 0.1 * rng.standard_normal(numpy_shape, dtype=np.float32)
    else:
        values = 0.02 * rng.standard_normal(numpy_shape, dtype=np.float32)
    if planned.ggml_type in FLOAT_TYPES:
        return values.astype(FLOAT_TYPES[planned.ggml_type])
    if planned.ggml_type in K_QUANTS:  # gguf-py cannot quantise these: random blocks of the same spread
        blocks = random_blocks(
            planned.ggml_type, rows=values.size // values.shape[-1], columns=values.shape[-1], rng=rng, std=0.02
        )
        return blocks.reshape(*values.shape[:-1], -1)
    result: np.ndarray = quants.quantize(values, planned.ggml_type)
    return result


def _rope_freqs(shape: ModelShape) -> np.ndarray:
    return np.asarray(shape.rope_freqs, dtype=np.float32)


def _writer(path: Path, *, shape: ModelShape, vocab: Vocabulary) -> GGUFWriter:
    arch = shape.architecture
    writer = GGUFWriter(path, arch)
    writer.add_name(shape.name)
    writer.add_file_type(LlamaFileType.MOSTLY_Q4_K_M if shape.quantised else LlamaFileType.MOSTLY_Q8_0)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.embedding_length)
    writer.add_block_count(shape.block_count)
    writer.add_feed_forward_length(shape.feed_forward_length)
    writer.add_head_count(shape.head_count)
    writer.add_head_count_kv(shape.head_count_kv)
    writer.add_rope_dimension_count(shape.rope_dim or shape.head_dim)
    writer.add_rope_freq_base(shape.rope_freq_base)
    writer.add_layer_norm_rms_eps(shape.rms_epsilon)
    writer.add_vocab_size(len(vocab.tokens))
    if shape.write_key_length:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    if shape.expert_count:
        writer.add_expert_count(shape.expert_count)
        writer.add_expert_used_count(shape.expert_used_count)
    if shape.expert_feed_forward_length:
        writer.add_expert_feed_forward_length(shape.expert_feed_forward_length)
    if shape.shared_expert_feed_forward_length:
        writer.add_expert_shared_feed_forward_length(shape.shared_expert_feed_forward_length)
    if shape.sliding_window:
        writer.add_sliding_window(shape.sliding_window)
    if shape.softcaps:
        writer.add_attn_logit_softcapping(shape.softcaps[0])
        writer.add_final_logit_softcapping(shape.softcaps[1])
    for key, value in shape.rope_keys:
        if isinstance(value, str):
            writer.add_string(f"{arch}.rope.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"{arch}.rope.{key}", value)
        else:
            writer.add_uint32(f"{arch}.rope.{key}", value)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(shape.tokenizer_pre)
    writer.add_token_list(list(vocab.tokens))
    writer.add_token_types(list(vocab.token_types))
    writer.add_token_merges(list(vocab.merges))
    writer.add_bos_token_id(vocab.bos_token_id)
    writer.add_eos_token_id(vocab.eos_token_id)
    writer.add_pad_token_id(vocab.bos_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    return writer
