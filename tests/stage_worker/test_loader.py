"""A GGUF file whose tensors do not fit the model is refused with an error that names the tensors, before serving."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from strata.gguf import read_header
from strata.gguf.sources import open_source
from strata.stage_worker.errors import ModelFileError
from strata.stage_worker.loader import LoadProgress, load_stage

Edits = dict[str, Callable[[tuple[int, ...]], np.ndarray | None]]  # tensor -> its replacement, or None: left out


def rewrite(source: Path, target: Path, edits: Edits) -> Path:
    """`source` with the same metadata and tensors, except those in `edits` (written as f32, or left out)."""
    reader = GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    writer = GGUFWriter(target, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape))  # ggml order -> torch order
        if tensor.name in edits:
            replacement = edits[tensor.name](shape)
            if replacement is not None:
                writer.add_tensor(tensor.name, replacement.astype(np.float32))
            continue
        writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def load(path: Path) -> None:
    source = open_source(str(path))
    try:
        header = read_header(source)
        load_stage(
            source=source,
            header=header,
            layer_start=0,
            layer_end=header.metadata["llama.block_count"],  # type: ignore[arg-type]
            dtype=torch.float32,
            device=torch.device("cpu"),
            progress=LoadProgress(),
        )
    finally:
        source.close()


def wider(shape: tuple[int, ...]) -> np.ndarray:
    return np.zeros((shape[0], shape[1] + 32))


def taller(shape: tuple[int, ...]) -> np.ndarray:
    return np.zeros((shape[0] + 1, shape[1]))


CASES: dict[str, tuple[Edits, str]] = {
    "a missing value projection": ({"blk.1.attn_v.weight": lambda _shape: None}, r"no tensor 'blk\.1\.attn_v\.weight'"),
    "a key projection of other width than q and v": (
        {"blk.0.attn_k.weight": wider},
        r"must share their columns: blk\.0\.attn_q\.weight \(\d+, \d+\), blk\.0\.attn_k\.weight \(\d+, \d+\)",
    ),
    "an up projection with a row too many": (
        {"blk.2.ffn_up.weight": taller},
        r"tensor 'blk\.2\.ffn_gate\.weight' \+ 'blk\.2\.ffn_up\.weight' has shape \(\d+, \d+\); expected",
    ),
    "an output projection with a row too many": (
        {"blk.0.attn_output.weight": taller},
        r"tensor 'blk\.0\.attn_output\.weight' has shape",
    ),
}


def test_the_untouched_rewrite_loads(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    # Holds the cases below to the edit alone: a copy with no edits loads.
    load(rewrite(tiny_models["llama"], tmp_path / "copy.gguf", {}))


@pytest.mark.parametrize("case", CASES)
def test_tensors_that_do_not_fit_are_named(case: str, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    edits, message = CASES[case]
    path = rewrite(tiny_models["llama"], tmp_path / "edited.gguf", edits)
    with pytest.raises(ModelFileError, match=message):
        load(path)
