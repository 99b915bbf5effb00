"""The header reader agrees with gguf-py's own reader on files gguf-py wrote, and needs nothing past the infos."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from strata.gguf import read_model_header


def write_small_file(path: Path, *, alignment: int | None) -> Path:
    writer = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_block_count(1)
    writer.add_string("general.name", "tiny")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "ü"])
    writer.add_array("llama.attention.head_count_kv", [2])
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    writer.add_tensor("blk.0.ffn_up.weight", np.zeros((3, 64), dtype=np.float16))
    quantised = gguf.quants.quantize(np.ones((2, 64), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("token_embd.weight", quantised, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "alignment",
    [
        pytest.param(None, id="the default alignment of 32 applies when the file states none"),
        pytest.param(64, id="a stated alignment of 64 moves the data section and every offset"),
        pytest.param(256, id="a stated alignment of 256 moves the data section and every offset"),
    ],
)
def test_tensor_infos_match_gguf_py_reader(tmp_path: Path, alignment: int | None) -> None:
    path = write_small_file(tmp_path / "small.gguf", alignment=alignment)
    reference = gguf.GGUFReader(path)
    header, size = read_model_header(str(path))
    assert size == path.stat().st_size
    assert header.data_offset == reference.data_offset
    assert header.alignment == (alignment or 32)
    assert [(t.name, t.offset, t.nbytes, t.dims) for t in header.tensors] == [
        (
            t.name,
            int(t.data_offset),
            int(t.n_bytes),
            tuple(map(int, t.shape)),
        )
        for t in reference.tensors
    ]
    assert header.metadata["tokenizer.ggml.tokens"] == ("a", "b", "ü")
    assert header.metadata["llama.attention.head_count_kv"] == (2,)


def test_a_file_cut_right_after_the_tensor_infos_reads_the_same(tmp_path: Path) -> None:
    path = write_small_file(tmp_path / "small.gguf", alignment=None)
    whole, _ = read_model_header(str(path))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: whole.tensor_info_end])
    header, size = read_model_header(cut.as_uri())
    assert size == whole.tensor_info_end
    assert header.tensors == whole.tensors
    assert header.metadata == whole.metadata
