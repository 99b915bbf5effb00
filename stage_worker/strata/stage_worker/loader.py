"""Turning a GGUF file into a StageModel: the config from the header, then only the tensors the span needs.

The model is built on the meta device; its parameter names say which GGUF tensors to read (the embedding for the
first stage, `blk.N.*` for the span, `output_norm` and `output` — or `token_embd` when tied — for the last). Each
tensor is read by range; a matrix's tensors of the quantised types a stage keeps become planes of their blocks on the
target device (strata.stage_worker.weights), everything else is dequantised (plain types on the device, others with
gguf-py) and cast to the compute dtype. A mixture's stacked experts ([n_expert, rows, columns]) are dequantised too,
whatever their type, for the grouped matmul of strata.stage_worker.experts; the planner counts them so
(strata.gguf.resident). The file's expert keys fill the config, and routing the table does not describe is refused.
LoadProgress counts bytes read against bytes needed so the operator can show load progress.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from strata.gguf import GGUFHeader, TensorInfo
from strata.gguf.architectures import ARCHITECTURES, Architecture
from strata.gguf.cursor import ByteSource
from strata.gguf.executable import not_executable_reason
from strata.gguf.resident import kept_quantised
from strata.gguf.rope_scaling import FREQ_FACTORS_TENSOR, RopeScalingError, rope_scaling
from strata.stage_worker.errors import ModelFileError
from strata.stage_worker.expert_keys import expert_fields
from strata.stage_worker.model import StageModel
from strata.stage_worker.model_config import ModelConfig
from strata.stage_worker.weights.formats import dequantize, split_planes
from strata.stage_worker.weights.linear import DenseRows, PackedEmbedding, PackedLinear, QuantizedRows, Rows
from torch import nn

READ_PIECE = 8 << 20
DEQUANTISE_PIECE = 16 << 20  # bytes of blocks dequantised at a time
TORCH_TYPES: dict[GGMLQuantizationType, torch.dtype] = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}


def config_from_header(header: GGUFHeader) -> ModelConfig:
    meta = header.metadata
    arch = str(meta.get("general.architecture", ""))
    reason = not_executable_reason(arch)  # the same check `strata serve` and the operator make before starting stages
    if reason is not None:
        raise ModelFileError(reason)
    description = ARCHITECTURES[arch]

    def number(key: str, default: float | None = None) -> float:
        value = meta.get(f"{arch}.{key}", default)
        if isinstance(value, tuple):  # a per-layer array; the llama family uses one value for every layer
            if len(set(value)) != 1:
                raise ModelFileError(f"{arch}.{key} differs between layers, which no architecture here does")
            value = value[0]
        if not isinstance(value, int | float):
            raise ModelFileError(f"the GGUF header has no usable {arch}.{key}")
        return value

    dim = int(number("embedding_length"))
    n_head = int(number("attention.head_count"))
    head_dim = int(number("attention.key_length", dim // n_head))
    tokens = meta.get("tokenizer.ggml.tokens")
    embd = header.tensor_by_name.get("token_embd.weight")
    vocab_default = len(tokens) if isinstance(tokens, tuple) else (embd.shape[0] if embd else None)
    n_layer = int(number("block_count"))
    window = _sliding_window(meta, description, n_layer=n_layer)
    attention_softcap, final_softcap = _softcaps(meta, description)
    experts = expert_fields(header, description, ffn_dim=int(number("feed_forward_length")))
    try:
        scaling = rope_scaling(meta, architecture=description, tensor_names=header.tensor_by_name)
    except RopeScalingError as e:
        raise ModelFileError(str(e)) from e
    return ModelConfig(
        architecture=arch,
        n_layer=n_layer,
        dim=dim,
        n_head=n_head,
        n_head_kv=int(number("attention.head_count_kv", n_head)),
        head_dim=head_dim,
        ffn_dim=int(number("feed_forward_length")),
        vocab_size=int(number("vocab_size", vocab_default)),
        norm_eps=float(number("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(number("rope.freq_base", 10000.0)),
        rope_dim=int(number("rope.dimension_count", head_dim)),
        rope_style=description.rope_style,
        attention_bias=_has(header, description, "attn.wqkv.bias"),
        qk_norm=_has(header, description, "attn.q_norm.weight"),
        tied_output="output.weight" not in header.tensor_by_name,
        activation=description.activation,
        embedding_scale=math.sqrt(dim) if description.embedding_scaled else 1.0,
        post_norms=description.post_norms,
        sliding_window=window,
        sliding_layers=tuple(description.sliding(il) for il in range(n_layer)) if description.sliding else (),
        sliding_rope_theta=_number(meta, f"{arch}.rope.freq_base_swa", description.sliding_rope_base),
        rope_scale=scaling.factor,
        rope_freqs=scaling.freq_factors,
        sliding_rope_scaled=description.sliding_rope_scaled,
        attention_softcap=attention_softcap,
        final_softcap=final_softcap,
        **experts,
    )


def _has(header: GGUFHeader, description: Architecture, parameter: str) -> bool:
    """The file's first block holds the tensors of a block parameter the architecture may have (biases, q/k norms)."""
    return f"blk.0.{description.tensor_names[parameter][0]}" in header.tensor_by_name


def _number(meta: Mapping[str, object], key: str, default: float | None) -> float | None:
    value = meta.get(key, default)
    if value is not None and not isinstance(value, int | float):
        raise ModelFileError(f"{key} is not a number: {value!r}")
    return value


def _sliding_window(meta: Mapping[str, object], description: Architecture, *, n_layer: int) -> int:
    """The window of the architecture's sliding layers, from the file; a file that says its layers slide in another
    pattern than the table's, or that has no window, is refused rather than run another way."""
    arch = description.name
    if description.sliding is None:
        return 0  # llama.cpp ignores a window stated for an architecture without sliding layers, and so do we
    window = _number(meta, f"{arch}.attention.sliding_window", None)
    if not window:
        raise ModelFileError(
            f"{arch} has sliding-window layers, but the file states no {arch}.attention.sliding_window"
        )
    stated = meta.get(f"{arch}.attention.sliding_window_pattern")
    if stated is not None:
        ours = tuple(description.sliding(il) for il in range(n_layer))
        theirs = tuple(bool(v) for v in stated) if isinstance(stated, tuple) else None
        if theirs != ours and stated != description.sliding.period:
            raise ModelFileError(
                f"{arch}.attention.sliding_window_pattern is {stated!r}; the stage worker runs {arch}'s sliding layers "
                f"as il % {description.sliding.period} < {description.sliding.sliding} only"
            )
    return int(window)


def _softcaps(meta: Mapping[str, object], description: Architecture) -> tuple[float, float]:
    """(attention, final) soft-caps: the file's, else the architecture's defaults; refused where it has none."""
    arch = description.name
    keys = (f"{arch}.attn_logit_softcapping", f"{arch}.final_logit_softcapping")
    if description.softcaps is None:
        stated = [key for key in keys if meta.get(key)]
        if stated:
            raise ModelFileError(f"the file states {', '.join(stated)}, which {arch} models do not soft-cap")
        return 0.0, 0.0
    attention, final = (
        _number(meta, key, default) or 0.0 for key, default in zip(keys, description.softcaps, strict=True)
    )
    return float(attention), float(final)


def gguf_names(config: ModelConfig, *, layer_start: int, parameter: str) -> tuple[str, ...]:
    """The GGUF tensors that a StageModel parameter holds, in the order they are stacked."""
    if parameter.startswith("layers."):
        _, index, path = parameter.split(".", 2)
        names = ARCHITECTURES[config.architecture].tensor_names[path]
        return tuple(f"blk.{layer_start + int(index)}.{name}" for name in names)
    if parameter == "output.weight" and config.tied_output:
        return ("token_embd.weight",)
    return (parameter,)


@dataclass
class LoadProgress:
    bytes_total: int = 0
    bytes_loaded: int = 0
    loaded: bool = False
    error: str = ""


def needed_tensors(model: StageModel, header: GGUFHeader) -> dict[tuple[str, ...], list[str]]:
    """GGUF tensor names (stacked) -> the StageModel parameters they fill (token_embd may fill both ends of one
    stage, and is then read once)."""
    needed: dict[tuple[str, ...], list[str]] = {}
    for parameter, _ in model.named_parameters():
        names = gguf_names(model.config, layer_start=model.layer_start, parameter=parameter)
        for name in names:
            if name not in header.tensor_by_name:
                raise ModelFileError(f"the GGUF file has no tensor {name!r}, which layers {model.layer_start}.. need")
        needed.setdefault(names, []).append(parameter)
    _refuse_unread(model, header, read={name for names in needed for name in names})
    return needed


# The tensors outside the blocks that some stage reads: the others are features no stage runs.
MODEL_TENSORS = frozenset({"token_embd.weight", "output_norm.weight", "output.weight", FREQ_FACTORS_TENSOR})


def _refuse_unread(model: StageModel, header: GGUFHeader, *, read: set[str]) -> None:
    """A tensor of the span's blocks that no parameter reads is a feature of the file the model would skip (experts,
    a fused matrix, another norm), and so is a tensor outside the blocks that no stage reads (LongRoPE's factors):
    refuse the file and name them, rather than compute something else."""
    span = range(model.layer_start, model.layer_end)
    unread = sorted(
        name
        for name in header.tensor_by_name
        if (name.startswith("blk.") and int(name.split(".")[1]) in span and name not in read)
        or (not name.startswith("blk.") and name not in MODEL_TENSORS)
    )
    if unread:
        shown = ", ".join(unread[:6]) + (f" and {len(unread) - 6} more" if len(unread) > 6 else "")
        raise ModelFileError(f"the {model.config.architecture} file has tensors the stage worker does not run: {shown}")


def read_raw(source: ByteSource, entry: TensorInfo, *, on_bytes: Callable[[int], None]) -> bytearray:
    """Read one tensor's bytes by range, in pieces so progress moves while a large tensor loads. A source gives
    fewer bytes than asked only where the file ends: the header promised more data than the file holds."""
    raw = bytearray(entry.nbytes)
    for start in range(0, entry.nbytes, READ_PIECE):
        size = min(READ_PIECE, entry.nbytes - start)
        piece = source.read(entry.offset + start, size)
        if len(piece) != size:
            end = entry.offset + start + len(piece)
            raise ModelFileError(
                f"the file ends at byte {end}, inside tensor {entry.name!r} (bytes {entry.offset} to "
                f"{entry.offset + entry.nbytes}): its tensor data is cut short"
            )
        raw[start : start + size] = piece
        on_bytes(size)
    return raw


def dequantize_on(raw: bytearray, entry: TensorInfo, *, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """One tensor as plain values in torch order and `dtype` on `device`, for the types a stage does not keep
    quantised, for norms and biases, and for a mixture's stacked experts.

    F16, BF16 and F32 travel to the device as stored; the types a stage keeps in blocks are dequantised there by their
    reference (strata.stage_worker.weights.formats, equal to gguf-py's values), a piece at a time so a layer's
    experts never need their float32 copy whole; other types go through gguf-py on the CPU.
    """
    data = torch.frombuffer(raw, dtype=torch.uint8)
    if entry.ggml_type in TORCH_TYPES:
        return data.to(device).view(TORCH_TYPES[entry.ggml_type]).to(dtype).reshape(entry.shape)
    block_elements, block_bytes = GGML_QUANT_SIZES[entry.ggml_type]
    row = entry.shape[-1] // block_elements * block_bytes
    if kept_quantised(entry.ggml_type):
        rows = entry.elements // entry.shape[-1]
        values = torch.empty(rows, entry.shape[-1], dtype=dtype, device=device)
        step = max(1, DEQUANTISE_PIECE // row)
        for start in range(0, rows, step):
            piece = data[start * row : (start + step) * row].to(device)
            planes = split_planes(piece, entry.ggml_type, rows=piece.numel() // row)
            values[start : start + step] = dequantize(planes, entry.ggml_type).to(dtype)
        return values.reshape(entry.shape)
    dequantised = gguf_dequantize(np.frombuffer(raw, dtype=np.uint8).reshape(-1, row), entry.ggml_type)
    return torch.from_numpy(np.asarray(dequantised, dtype=np.float32)).to(device).to(dtype).reshape(entry.shape)


def matrix_rows(tensors: list[tuple[TensorInfo, bytearray]], *, device: torch.device, dtype: torch.dtype) -> list[Rows]:
    """The rows of one model matrix from the GGUF tensors stacked into it: each run of tensors of one kept quantised
    type becomes one part in its blocks, every other run one part of plain values."""
    parts: list[Rows] = []
    for kept, run in itertools.groupby(
        tensors, key=lambda t: t[0].ggml_type if kept_quantised(t[0].ggml_type) else None
    ):
        group = list(run)
        if kept is None:
            parts.append(DenseRows(torch.cat([dequantize_on(raw, e, device=device, dtype=dtype) for e, raw in group])))
            continue
        split = [
            split_planes(torch.frombuffer(raw, dtype=torch.uint8).to(device), kept, rows=e.shape[0]) for e, raw in group
        ]
        planes = {name: torch.cat([p[name] for p in split]) for name in split[0]}
        parts.append(QuantizedRows(planes, kept, columns=group[0][0].shape[-1]))
    return parts


def load_stage(
    *,
    source: ByteSource,
    header: GGUFHeader,
    layer_start: int,
    layer_end: int,
    dtype: torch.dtype,
    device: torch.device,
    progress: LoadProgress,
    cancelled: threading.Event | None = None,
) -> StageModel:
    config = config_from_header(header)
    with torch.device("meta"):
        model = StageModel(config, layer_start=layer_start, layer_end=layer_end)
    needed = needed_tensors(model, header)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}  # the meta model's, before matrices move
    progress.bytes_total = sum(header.tensor_by_name[name].nbytes for names in needed for name in names)

    def count(n: int) -> None:
        progress.bytes_loaded += n

    for names, parameters in needed.items():
        tensors = []
        for name in names:
            if cancelled is not None and cancelled.is_set():
                raise ModelFileError("loading was cancelled")
            entry = header.tensor_by_name[name]
            tensors.append((entry, read_raw(source, entry, on_bytes=count)))
        _check_shape(tensors, expected=shapes[parameters[0]])
        owner, _, leaf = parameters[0].rpartition(".")
        if leaf == "weight" and isinstance(model.get_submodule(owner), nn.Linear | nn.Embedding):
            _assign_matrix(model, parameters, matrix_rows(tensors, device=device, dtype=dtype), dtype=dtype)
            continue
        values = torch.cat(
            [dequantize_on(raw, entry, device=device, dtype=dtype) for entry, raw in tensors],
            dim=_rows_axis(tensors[0][0].shape),
        )
        for parameter in parameters:
            owner, _, leaf = parameter.rpartition(".")
            setattr(model.get_submodule(owner), leaf, nn.Parameter(values, requires_grad=False))
        del tensors
    progress.loaded = True
    return model.eval()


def _rows_axis(shape: tuple[int, ...]) -> int:
    """The axis tensors stacked into one parameter join along: the rows of a matrix (or the values of a vector), and
    of each expert in a mixture's [n_expert, rows, columns]."""
    return max(len(shape) - 2, 0)


def _check_shape(tensors: list[tuple[TensorInfo, bytearray]], *, expected: tuple[int, ...]) -> None:
    """Tensors stacked into one parameter share every axis but their rows, and together have its shape."""
    first = tensors[0][0].shape
    axis = _rows_axis(first)

    def across(shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape[:axis] + shape[axis + 1 :]

    names = [entry.name for entry, _ in tensors]
    if any(across(entry.shape) != across(first) or len(entry.shape) != len(first) for entry, _ in tensors):
        shapes = ", ".join(f"{entry.name} {tuple(entry.shape)}" for entry, _ in tensors)
        raise ModelFileError(f"tensors stacked into one parameter must share every axis but their rows: {shapes}")
    shape = (*first[:axis], sum(entry.shape[axis] for entry, _ in tensors), *first[axis + 1 :])
    if shape != expected:
        joined = " + ".join(repr(name) for name in names)
        raise ModelFileError(f"tensor {joined} has shape {shape}; expected {expected}")


def _assign_matrix(model: StageModel, parameters: list[str], parts: list[Rows], *, dtype: torch.dtype) -> None:
    """Put a matrix's parts where the meta model has an nn.Linear or nn.Embedding (a tied head shares token_embd's
    parts with the embedding)."""
    for parameter in parameters:
        path = parameter.rpartition(".")[0]
        parent, _, child = path.rpartition(".")
        if isinstance(model.get_submodule(path), nn.Embedding):
            setattr(model.get_submodule(parent), child, PackedEmbedding(parts[0], dtype=dtype))
        else:
            setattr(model.get_submodule(parent), child, PackedLinear(parts))
