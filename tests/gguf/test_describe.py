"""ModelInfo from generated files matches what the generator wrote; figures are derived from the generator's record."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import pytest
from strata.cli import main
from strata.gguf import CacheType, MetadataError, inspect_model
from strata.gguf.testmodels import LARGE_SHAPES, WrittenModel, write_header_only_model, write_test_model

# The fields `strata inspect --json` documents; scripts read them, so each must stay present.
INSPECT_FIELDS = {
    "architecture",
    "block_count",
    "embedding_length",
    "head_count",
    "head_count_kv",
    "key_length",
    "value_length",
    "context_length",
    "vocab_size",
    "layer_bytes",
    "non_layer_bytes",
    "total_bytes",
    "layer_resident_bytes",
    "non_layer_resident_bytes",
    "resident_total_bytes",
    "tensor_types",
    "kv_bytes_per_token",
    "sliding_window",
    "header_bytes_read",
    "executable",
}


ROLES = {"token_embd": "token_embd.weight", "output_norm": "output_norm.weight", "output": "output.weight"}


def expected_non_layer_bytes(written: WrittenModel) -> dict[str, int]:
    names = {t.name for t in written.tensors}
    return {role: written.tensor_bytes(name) for role, name in ROLES.items() if name in names}


def expected_non_layer_resident_bytes(written: WrittenModel) -> dict[str, int]:
    names = {t.name for t in written.tensors}
    return {role: written.tensor_resident_bytes(name) for role, name in ROLES.items() if name in names}


def write(kind: str, tmp_path: Path) -> WrittenModel:
    if kind in LARGE_SHAPES:
        return write_header_only_model(tmp_path / f"{kind}.gguf", shape=kind)
    return write_test_model(tmp_path / f"{kind}.gguf", architecture=kind, seed=11)


MODELS = [
    pytest.param("llama", id="a small llama model"),
    pytest.param("mistral", id="a small mistral model written as llama"),
    pytest.param("qwen2", id="a small qwen2 model with attention biases"),
    pytest.param("qwen3", id="a small qwen3 model whose head width is stated, not derived"),
    pytest.param("qwen3moe", id="a small qwen3moe mixture of experts"),
    pytest.param("mixtral", id="a small Mixtral-style mixture written as llama"),
    pytest.param("llama3-70b", id="a header-only Llama-3-70B-like model"),
    pytest.param("qwen3-30b-a3b", id="a header-only Qwen3-30B-A3B-like mixture of experts"),
]


@pytest.mark.parametrize("kind", MODELS)
def test_model_info_matches_what_was_written(tmp_path: Path, kind: str) -> None:
    written = write(kind, tmp_path)
    shape = written.shape
    info = inspect_model(str(written.path))
    assert info.architecture == shape.architecture
    assert info.name == shape.name
    assert info.block_count == shape.block_count
    assert info.embedding_length == shape.embedding_length
    assert info.head_count == shape.head_count
    assert info.head_count_kv == (shape.head_count_kv,) * shape.block_count
    assert info.key_length == info.value_length == shape.head_dim
    assert info.context_length == shape.context_length
    assert info.vocab_size == written.vocab_size
    assert list(info.layer_bytes) == written.layer_bytes()
    assert info.non_layer_bytes == expected_non_layer_bytes(written)
    assert info.total_bytes == sum(t.nbytes for t in written.tensors)
    assert list(info.layer_resident_bytes) == written.layer_resident_bytes()
    assert info.non_layer_resident_bytes == expected_non_layer_resident_bytes(written)
    assert info.resident_total_bytes == sum(t.resident_bytes for t in written.tensors)
    assert info.output_tied == shape.tied_output
    assert (info.expert_count, info.expert_used_count) == (shape.expert_count, shape.expert_used_count)
    assert info.rope is not None
    assert (info.rope.freq_base, info.rope.dimension_count) == (shape.rope_freq_base, shape.head_dim)
    assert (info.tokenizer_model, info.tokenizer_pre, info.has_chat_template) == ("gpt2", shape.tokenizer_pre, True)
    assert info.executable == (shape.architecture in {"llama", "qwen2", "qwen3", "qwen3moe"})
    assert info.sliding_window is None
    assert info.file_bytes == written.path.stat().st_size
    assert info.header_bytes_read <= info.file_bytes


@pytest.mark.parametrize(
    ("cache_type", "bytes_per_token"),
    [
        pytest.param(CacheType.F16, 131_072, id="Llama-3-8B holds 131,072 bytes of f16 KV per token"),
        pytest.param(CacheType.Q8_0, 69_632, id="Llama-3-8B holds 69,632 bytes of q8_0 KV per token"),
    ],
)
def test_kv_bytes_per_token_for_the_llama_3_8b_shape(
    tmp_path: Path, cache_type: CacheType, bytes_per_token: int
) -> None:
    info = inspect_model(str(write_header_only_model(tmp_path / "8b.gguf", shape="llama3-8b").path))
    assert info.kv_bytes_per_token(type_k=cache_type, type_v=cache_type) == bytes_per_token


@pytest.mark.parametrize(
    ("architecture", "is_sliding"),
    [
        pytest.param("gemma2", lambda il: il % 2 == 0, id="gemma2 slides on even layers"),
        pytest.param("gemma3", lambda il: il % 6 < 5, id="gemma3 slides on five layers of every six"),
        pytest.param("llama", lambda il: False, id="llama ignores a stated window"),
    ],
)
def test_sliding_window_layers_follow_the_architecture(tmp_path: Path, architecture: str, is_sliding: object) -> None:
    shape = dataclasses.replace(
        LARGE_SHAPES["llama3-8b"], architecture=architecture, block_count=12, sliding_window=512
    )
    info = inspect_model(str(write_header_only_model(tmp_path / "swa.gguf", shape=shape).path))
    assert callable(is_sliding)
    if architecture == "llama":
        assert info.sliding_window is None
    else:
        assert info.sliding_window is not None
        assert info.sliding_window.window == 512
        assert info.sliding_window.layers == tuple(is_sliding(il) for il in range(12))


def write_minimal(path: Path, *, keys: dict[str, object]) -> Path:
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in keys.items():
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_string(key, str(value))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(32, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


BASE = {
    "llama.block_count": 3,
    "llama.embedding_length": 96,
    "llama.attention.head_count": 4,
    "llama.context_length": 64,
}


def test_per_layer_kv_heads_and_the_key_length_fallback(tmp_path: Path) -> None:
    path = write_minimal(tmp_path / "m.gguf", keys={**BASE, "llama.attention.head_count_kv": [4, 0, 2]})
    info = inspect_model(str(path))
    assert info.head_count_kv == (4, 0, 2)
    assert info.key_length == info.value_length == 96 // 4
    assert info.kv_bytes_per_token(type_k=CacheType.F16, type_v=CacheType.F16) == (4 + 0 + 2) * 24 * 2 * 2
    assert info.output_tied
    assert info.vocab_size == 0


@pytest.mark.parametrize(
    ("keys", "field"),
    [
        pytest.param(
            {k: v for k, v in BASE.items() if k != "llama.block_count"}, "llama.block_count", id="no block count"
        ),
        pytest.param({**BASE, "llama.context_length": "long"}, "llama.context_length", id="a context length string"),
        pytest.param({**BASE, "llama.attention.head_count_kv": [1, 2]}, "llama.attention.head_count_kv", id="2 of 3"),
        pytest.param({**BASE, "llama.block_count": 0}, "llama.block_count", id="a model with zero layers"),
    ],
)
def test_missing_or_mistyped_keys_name_the_key(tmp_path: Path, keys: dict[str, object], field: str) -> None:
    with pytest.raises(MetadataError) as raised:
        inspect_model(str(write_minimal(tmp_path / "m.gguf", keys=keys)))
    assert raised.value.field == field


def test_the_command_prints_json_with_the_documented_fields(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    written = write_test_model(tmp_path / "q.gguf", architecture="qwen2", seed=1)
    assert main(["inspect", str(written.path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) >= INSPECT_FIELDS
    shape = written.shape
    assert (report["architecture"], report["block_count"], report["embedding_length"]) == (
        "qwen2",
        shape.block_count,
        shape.embedding_length,
    )
    assert (report["head_count"], report["head_count_kv"]) == (
        shape.head_count,
        [shape.head_count_kv] * shape.block_count,
    )
    assert (report["key_length"], report["value_length"]) == (shape.head_dim, shape.head_dim)
    assert (report["context_length"], report["vocab_size"]) == (shape.context_length, written.vocab_size)
    assert set(report["kv_bytes_per_token"]) == {t.value for t in CacheType}
    assert report["layer_bytes"] == written.layer_bytes()
    assert report["non_layer_bytes"] == expected_non_layer_bytes(written)
    assert report["total_bytes"] == sum(t.nbytes for t in written.tensors)
    assert report["layer_resident_bytes"] == written.layer_resident_bytes()
    assert report["non_layer_resident_bytes"] == expected_non_layer_resident_bytes(written)
    assert report["resident_total_bytes"] == sum(t.resident_bytes for t in written.tensors)
    assert {name: entry["tensors"] for name, entry in report["tensor_types"].items()} == Counter(
        t.ggml_type.name for t in written.tensors
    )
    kept = {name: entry["kept_quantised"] for name, entry in report["tensor_types"].items()}
    assert kept == {"F16": False, "F32": False, "Q4_0": True, "Q8_0": True}
    n_kv = written.shape.head_count_kv * written.shape.head_dim * written.shape.block_count
    assert report["kv_bytes_per_token"]["f16"] == 2 * n_kv * 2
    assert report["kv_bytes_per_token"]["q8_0"] == 2 * n_kv // 32 * 34
    assert report["header_bytes_read"] > 0
    assert report["sliding_window"] is None
    assert report["executable"] is True
    assert main(["inspect", str(written.path)]) == 0
    assert "KV/token q8_0" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("content", "message"),
    [
        pytest.param(b"not a model", "BadMagicError", id="a text file is refused as not GGUF"),
        pytest.param(b"GGUF\x03\x00\x00\x00", "TruncatedError", id="a file cut inside the header is truncated"),
    ],
)
def test_the_command_exits_1_on_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, message: str
) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    assert main(["inspect", str(path)]) == 1
    assert message in capsys.readouterr().err


def write_mixed_types(path: Path) -> Path:
    """A header-only model whose tensors mix the types a stage keeps in their blocks (Q4_K, Q6_K, Q8_0) with those it
    holds as plain 2-byte values (an F32 norm, a Q3_K matrix); rows of 256 values, a whole number of K-quant blocks."""
    tensors = [
        ("token_embd.weight", (256, 1000), gguf.GGMLQuantizationType.Q4_K),
        ("blk.0.attn_norm.weight", (256,), gguf.GGMLQuantizationType.F32),
        ("blk.0.attn_q.weight", (256, 256), gguf.GGMLQuantizationType.Q8_0),
        ("blk.0.ffn_down.weight", (256, 256), gguf.GGMLQuantizationType.Q3_K),
        ("output.weight", (256, 1000), gguf.GGMLQuantizationType.Q6_K),
    ]
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in {**BASE, "llama.embedding_length": 256}.items():
        writer.add_uint32(key, value)
    for name, dims, ggml_type in tensors:
        block_values, block_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
        nbytes = int(np.prod(dims)) // block_values * block_bytes
        writer.add_tensor_info(name, tuple(reversed(dims)), np.dtype(np.float32), nbytes, raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("kind", "shown"),
    [
        pytest.param(
            "llama3-8b",
            "total weights       5,172,420,608 B (4.82 GiB) in the file, 5,257,691,136 B (4.90 GiB) loaded",
            id="a K-quant model shows its file size and the slightly larger size it takes loaded",
        ),
        pytest.param(
            "llama3-8b",
            "  token_embd        295,501,824 B (281.81 MiB) in the file, 303,710,208 B (289.64 MiB) loaded",
            id="a Q4_K token_embd takes 148 bytes for each 144-byte block once its sub-scales are unpacked",
        ),
        pytest.param(
            "llama3-8b",
            "  output            430,940,160 B (410.98 MiB)",
            id="a Q6_K output head is kept in its blocks, the same size loaded, so it is shown once",
        ),
        pytest.param(
            "llama",
            "  token_embd        256,000 B (0.24 MiB)",
            id="an F16 token_embd is the same size in the file and loaded, so it is shown once",
        ),
        pytest.param(
            "llama",
            "  output            136,000 B (0.13 MiB)",
            id="a Q8_0 output head is kept in its blocks, so it is shown once",
        ),
        pytest.param(
            "llama",
            "  output_norm       512 B (0.00 MiB) in the file, 256 B (0.00 MiB) loaded",
            id="an F32 norm is held at 2 bytes per value, half its size in the file",
        ),
        pytest.param(
            "llama3-8b",
            "tensor types        Q4_K x161, Q6_K x65 kept in their blocks; F32 x65 as plain values",
            id="a K-quant download keeps its Q4_K and Q6_K tensors in their blocks and its F32 norms as plain values",
        ),
        pytest.param(
            "mixed",
            "tensor types        Q4_K x1, Q6_K x1, Q8_0 x1 kept in their blocks; F32 x1, Q3_K x1 as plain values",
            id="a Q3_K tensor is listed with the plain values: a stage dequantises it",
        ),
        pytest.param(
            "mixed",
            "total weights       452,816 B (0.43 MiB) in the file, 559,216 B (0.53 MiB) loaded",
            id="a dequantised Q3_K tensor grows to 2 bytes per value in the loaded total",
        ),
    ],
)
def test_the_table_shows_file_and_loaded_sizes_where_they_differ(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str, shown: str
) -> None:
    path = write_mixed_types(tmp_path / "mixed.gguf") if kind == "mixed" else write(kind, tmp_path).path
    assert main(["inspect", str(path)]) == 0
    assert shown in capsys.readouterr().out.splitlines()
