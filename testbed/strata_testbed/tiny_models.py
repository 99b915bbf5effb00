"""Small llama-family GGUF files written with gguf-py, so the stage worker's tests need no downloaded weights.

Norms are F32 and the matrices mix F16, Q8_0 and Q4_0, as real quantised files do. HF transformers loads these
files with gguf_file=, which gives the reference the tests compare against.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize


@dataclass(frozen=True)
class TinyShape:
    architecture: str
    n_layer: int = 3
    dim: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    ffn_dim: int = 128
    vocab: int = 256
    context: int = 256
    rope_theta: float = 10000.0
    name: str = "tiny"
    tied: bool = False
    head_dim: int | None = None  # written as attention.key_length; dim // n_head when None

    @property
    def key_length(self) -> int:
        return self.head_dim or self.dim // self.n_head


ARCHITECTURES = {
    "llama": TinyShape(architecture="llama", name="tiny-llama"),
    "mistral": TinyShape(architecture="llama", name="tiny-mistral", dim=128, n_head_kv=1, rope_theta=1e6),
    "qwen2": TinyShape(architecture="qwen2", name="tiny-qwen2", tied=True, rope_theta=1e6),
    "qwen3": TinyShape(
        architecture="qwen3", name="tiny-qwen3", rope_theta=1e6, head_dim=128
    ),  # HF reads no key_length,
}
MATRIX_TYPES = (GGMLQuantizationType.F16, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0)


def write_tiny_model(path: Path, shape: TinyShape, *, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    arch = shape.architecture
    head_dim = shape.key_length
    writer = GGUFWriter(str(path), arch)
    writer.add_name(shape.name)
    writer.add_block_count(shape.n_layer)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.dim)
    writer.add_feed_forward_length(shape.ffn_dim)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_layer_norm_rms_eps(1e-6)
    if shape.head_dim is not None:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_vocab_size(shape.vocab)
    writer.add_file_type(1)

    count = 0

    def matrix(name: str, rows: int, cols: int, scale: float) -> None:
        nonlocal count
        values = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        qtype = MATRIX_TYPES[count % len(MATRIX_TYPES)]
        count += 1
        writer.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)

    def vector(name: str, size: int, *, around: float) -> None:
        writer.add_tensor(name, (around + rng.standard_normal(size) * 0.1).astype(np.float32))

    matrix("token_embd.weight", shape.vocab, shape.dim, 1.0)
    for il in range(shape.n_layer):
        blk = f"blk.{il}"
        vector(f"{blk}.attn_norm.weight", shape.dim, around=1.0)
        matrix(f"{blk}.attn_q.weight", shape.n_head * head_dim, shape.dim, shape.dim**-0.5)
        matrix(f"{blk}.attn_k.weight", shape.n_head_kv * head_dim, shape.dim, shape.dim**-0.5)
        matrix(f"{blk}.attn_v.weight", shape.n_head_kv * head_dim, shape.dim, shape.dim**-0.5)
        if arch == "qwen2":
            vector(f"{blk}.attn_q.bias", shape.n_head * head_dim, around=0.0)
            vector(f"{blk}.attn_k.bias", shape.n_head_kv * head_dim, around=0.0)
            vector(f"{blk}.attn_v.bias", shape.n_head_kv * head_dim, around=0.0)
        if arch == "qwen3":
            vector(f"{blk}.attn_q_norm.weight", head_dim, around=1.0)
            vector(f"{blk}.attn_k_norm.weight", head_dim, around=1.0)
        matrix(f"{blk}.attn_output.weight", shape.dim, shape.n_head * head_dim, shape.dim**-0.5)
        vector(f"{blk}.ffn_norm.weight", shape.dim, around=1.0)
        matrix(f"{blk}.ffn_gate.weight", shape.ffn_dim, shape.dim, shape.dim**-0.5)
        matrix(f"{blk}.ffn_up.weight", shape.ffn_dim, shape.dim, shape.dim**-0.5)
        matrix(f"{blk}.ffn_down.weight", shape.dim, shape.ffn_dim, shape.ffn_dim**-0.5)
    vector("output_norm.weight", shape.dim, around=1.0)
    if not shape.tied:
        matrix("output.weight", shape.vocab, shape.dim, shape.dim**-0.5)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
