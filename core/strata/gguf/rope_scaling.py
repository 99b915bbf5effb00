"""How a file asks for its RoPE to be stretched beyond the context it was trained at, and which of those asks the
stages honour.

llama.cpp's keys (`{arch}.rope.scaling.*`) and tensors are the reference, since it wrote the files:
- `rope.scaling.type` defaults to "linear" when absent (llama.cpp's rule), and `rope.scaling.factor` (or the older
  `rope.scale_linear`) to 1. Linear scaling divides every position by the factor, which is what HF's "linear" rope
  type computes by dividing the frequencies.
- Llama 3.1's "llama3" scaling has no key: llama.cpp's converter folds HF's parameters into a `rope_freqs.weight`
  tensor of one divisor per frequency, which llama.cpp applies for the architectures that read it (a table field).
- YaRN and LongRoPE (Phi-3's `rope_factors_long/short`) are not applied here; a file that asks for them, for an
  attention factor, or for any scaling key this module does not know is refused with the key and value named, so
  nothing the file states is silently skipped.

The same reading serves the stage worker's loader (which raises) and `strata inspect`, `strata serve` and the
operator (which refuse the model before starting stages, through ModelInfo.unsupported).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from strata.gguf.architectures import Architecture

FREQ_FACTORS_TENSOR = "rope_freqs.weight"
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3's 128k models
HONOURED_TYPES = ("none", "linear")
# Keys that say nothing the honoured types compute differently: the context the model was trained at, and whether it
# was fine-tuned at the scaled length (llama.cpp reads them for YaRN only).
INFORMATIONAL_KEYS = ("rope.scaling.original_context_length", "rope.scaling.finetuned")


class RopeScalingError(ValueError):
    """The file asks for a RoPE scaling the stages do not apply; the message names the key or tensor and its value."""


@dataclass(frozen=True)
class RopeScaling:
    factor: float = 1.0  # positions are divided by it (linear scaling)
    freq_factors: bool = False  # rope_freqs.weight divides each frequency (Llama 3.1)


def rope_scaling(
    metadata: Mapping[str, object], *, architecture: Architecture, tensor_names: Collection[str]
) -> RopeScaling:
    """The RoPE scaling the file states, as the stages apply it; RopeScalingError for any they do not."""
    arch = architecture.name
    longrope = [name for name in LONGROPE_TENSORS if name in tensor_names]
    if longrope:  # llama.cpp's converter states no scaling type for them, only these tensors and an attention factor
        raise RopeScalingError(
            f"the file has {' and '.join(longrope)}: LongRoPE scaling, which the stage worker does not apply"
        )
    type_key, factor_key = f"{arch}.rope.scaling.type", f"{arch}.rope.scaling.factor"
    kind = metadata.get(type_key, "linear")
    if kind not in HONOURED_TYPES:
        raise RopeScalingError(
            f"{type_key} is {kind!r}: the stage worker applies {' and '.join(HONOURED_TYPES)} RoPE scaling and "
            f"llama.cpp's {FREQ_FACTORS_TENSOR} factors only"
        )
    stated_key = factor_key if factor_key in metadata else f"{arch}.rope.scale_linear"
    factor = metadata.get(stated_key, 0.0)
    if isinstance(factor, bool) or not isinstance(factor, int | float) or factor < 0:
        raise RopeScalingError(f"{stated_key} is {factor!r}, not a non-negative number")
    factor = float(factor) or 1.0  # llama.cpp reads 0 as "not scaled"
    if kind == "none" and factor != 1.0:
        raise RopeScalingError(f"{type_key} is 'none' but {stated_key} is {factor:g}: the file contradicts itself")
    known = {type_key, factor_key, *(f"{arch}.{k}" for k in INFORMATIONAL_KEYS)}
    for key, value in sorted(metadata.items()):
        neutral = key == f"{arch}.rope.scaling.attn_factor" and value == 1.0  # multiplies cos and sin by 1
        if key.startswith(f"{arch}.rope.scaling.") and key not in known and not neutral:
            raise RopeScalingError(f"{key} is {value!r}, which the stage worker's RoPE does not apply")
    freq_factors = FREQ_FACTORS_TENSOR in tensor_names
    if freq_factors and not architecture.rope_freqs:
        raise RopeScalingError(f"the file has {FREQ_FACTORS_TENSOR}, which {arch} models do not apply")
    return RopeScaling(factor=factor, freq_factors=freq_factors)


def rope_scaling_refusal(
    metadata: Mapping[str, object], *, architecture: Architecture, tensor_names: Collection[str]
) -> str | None:
    """Why the stages cannot apply the file's RoPE scaling, or None when they can."""
    try:
        rope_scaling(metadata, architecture=architecture, tensor_names=tensor_names)
    except RopeScalingError as e:
        return str(e)
    return None
