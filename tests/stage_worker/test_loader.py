"""A GGUF file whose tensors do not fit the model is refused with an error that names the tensors, before serving."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from strata.gguf import read_header
from strata.gguf.sources import open_source
from strata.gguf.testmodels import SMALL_SHAPES, ModelShape, write_test_model
from strata.stage_worker.errors import ModelFileError
from strata.stage_worker.loader import LoadProgress, load_stage
from strata_testbed.stages import load_spans

Edits = dict[str, Callable[[tuple[int, ...]], np.ndarray | None]]  # tensor -> its replacement, or None: left out


def rewrite(source: Path, target: Path, edits: Edits, *, added: dict[str, np.ndarray] | None = None) -> Path:
    """`source` with the same metadata and tensors, except those in `edits` (written as f32, or left out), and the
    `added` tensors after them."""
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
    for name, values in (added or {}).items():
        writer.add_tensor(name, values.astype(np.float32))
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
        r"must share every axis but their rows: "
        r"blk\.0\.attn_q\.weight \(\d+, \d+\), blk\.0\.attn_k\.weight \(\d+, \d+\)",
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


OUTSIDE_THE_BLOCKS: dict[str, tuple[str, dict[str, np.ndarray], str]] = {
    "an output bias (Phi-2's) is named": ("llama", {"output.bias": np.zeros(64)}, r"does not run: output\.bias"),
    "Phi-3's LongRoPE factors are named as LongRoPE": (
        "phi3",
        {"rope_factors_long.weight": np.ones(16), "rope_factors_short.weight": np.ones(16)},
        r"rope_factors_long\.weight and rope_factors_short\.weight: LongRoPE scaling, which the stage worker does not",
    ),
}


@pytest.mark.parametrize("case", OUTSIDE_THE_BLOCKS)
def test_a_tensor_outside_the_blocks_that_no_stage_reads_is_named(
    case: str, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """Running without them would compute another model."""
    architecture, added, message = OUTSIDE_THE_BLOCKS[case]
    path = rewrite(tiny_models[architecture], tmp_path / "edited.gguf", {}, added=added)
    with pytest.raises(ModelFileError, match=message):
        load_any(path)


def load_any(path: Path) -> None:
    """Load every layer of a file of any architecture."""
    load_spans(path)


# What a file says, through a generated shape, that the architecture table has no place for.
FEATURES_REFUSED: dict[str, tuple[ModelShape, str]] = {
    "a llama file with Gemma's post-norms names the tensors it would skip": (
        dataclasses.replace(SMALL_SHAPES["llama"], post_norms=True),
        r"tensors the stage worker does not run: blk\.0\.post_attention_norm\.weight, blk\.0\.post_ffw_norm\.weight",
    ),
    "a llama file that states soft-caps names the keys": (
        dataclasses.replace(SMALL_SHAPES["llama"], softcaps=(50.0, 30.0)),
        r"llama\.attn_logit_softcapping, llama\.final_logit_softcapping, which llama models do not soft-cap",
    ),
    "a gemma3 file without a window is refused, not run with full attention": (
        dataclasses.replace(SMALL_SHAPES["gemma3"], sliding_window=0),
        r"gemma3 has sliding-window layers, but the file states no gemma3\.attention\.sliding_window",
    ),
}


@pytest.mark.parametrize("case", FEATURES_REFUSED)
def test_features_the_table_does_not_describe_are_refused(case: str, tmp_path: Path) -> None:
    shape, message = FEATURES_REFUSED[case]
    path = write_test_model(tmp_path / "model.gguf", architecture=shape.architecture, shape=shape).path
    with pytest.raises(ModelFileError, match=message):
        load_any(path)
