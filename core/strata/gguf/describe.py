"""From a raw GGUF header to ModelInfo: llama.cpp's key names, fallbacks and per-architecture layer patterns.

The reader (header.py) knows bytes; this module knows what the keys mean. Fallbacks follow llama.cpp: key and value
lengths default to n_embd / n_head, KV heads to n_head, and sliding-window layers are chosen by a per-architecture
pattern table. A key that is missing or of the wrong type raises MetadataError naming the key and where it sits.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from strata.gguf.architectures import ARCHITECTURES
from strata.gguf.errors import MetadataError
from strata.gguf.executable import header_refusal
from strata.gguf.header import GGUFHeader
from strata.gguf.model import ModelInfo, RopeSettings, SlidingWindow
from strata.gguf.resident import CPU_BYTES, resident_bytes
from strata.gguf.rope_scaling import rope_scaling_refusal
from strata.gguf.values import Value

MAX_BLOCK_COUNT = 1 << 16
KV_SECTION_OFFSET = 24  # magic, version, tensor_count, kv_count

# Which layers use sliding-window attention, as llama.cpp decides for each architecture (the architecture table's).
SLIDING_PATTERNS: dict[str, Callable[[int], bool]] = {
    name: arch.sliding for name, arch in ARCHITECTURES.items() if arch.sliding is not None
}

_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.")


class _Keys:
    """Typed access to metadata, raising MetadataError that names the key and its offset."""

    def __init__(self, header: GGUFHeader) -> None:
        self._header = header

    def error(self, key: str, reason: str) -> MetadataError:
        return MetadataError(field=key, offset=self._header.key_offsets.get(key, KV_SECTION_OFFSET), reason=reason)

    def get(self, key: str) -> Value | None:
        return self._header.metadata.get(key)

    def string(self, key: str) -> str | None:
        value = self.get(key)
        if value is not None and not isinstance(value, str):
            raise self.error(key, f"expected a string, found {type(value).__name__}")
        return value

    def integer(self, key: str, *, default: int | None = None, minimum: int = 0, maximum: int = 1 << 62) -> int:
        value = self.get(key)
        if value is None:
            if default is None:
                raise self.error(key, "missing from the key/value section")
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"expected an integer, found {type(value).__name__}")
        if not minimum <= value <= maximum:
            raise self.error(key, f"{value} is outside [{minimum}, {maximum}]")
        return value

    def number(self, key: str) -> float | None:
        value = self.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise self.error(key, f"expected a number, found {type(value).__name__}")
        return None if value is None else float(value)

    def per_layer(self, key: str, *, layers: int, default: int) -> tuple[int, ...]:
        """A scalar repeated for every layer, or an array with one integer per layer."""
        value = self.get(key)
        if not isinstance(value, tuple):
            return (self.integer(key, default=default),) * layers
        if len(value) != layers or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
            raise self.error(key, f"expected {layers} non-negative integers, one per layer")
        return tuple(int(v) for v in value)


def describe(header: GGUFHeader, *, file_bytes: int | None = None) -> ModelInfo:
    keys = _Keys(header)
    arch = keys.string("general.architecture")
    if not arch:
        raise keys.error("general.architecture", "missing from the key/value section")
    n_layer = keys.integer(f"{arch}.block_count", minimum=1, maximum=MAX_BLOCK_COUNT)
    n_embd = keys.integer(f"{arch}.embedding_length", minimum=1)
    n_head = max(keys.per_layer(f"{arch}.attention.head_count", layers=n_layer, default=0))
    if n_head < 1:
        raise keys.error(f"{arch}.attention.head_count", "must be at least 1")
    head_count_kv = keys.per_layer(f"{arch}.attention.head_count_kv", layers=n_layer, default=n_head)
    stored, resident = _weight_bytes(header, layers=n_layer)
    on_cpu = sum(
        resident_bytes(t.ggml_type, name=t.name, elements=t.elements, stored_bytes=t.nbytes, compute_bytes=CPU_BYTES)
        for t in header.tensors
    )
    tokens = keys.get("tokenizer.ggml.tokens")
    vocab_size = len(tokens) if isinstance(tokens, tuple) else keys.integer(f"{arch}.vocab_size", default=0)
    if not vocab_size and "token_embd.weight" in header.tensor_by_name:
        vocab_size = header.tensor_by_name["token_embd.weight"].shape[0]
    key_length = keys.integer(f"{arch}.attention.key_length", default=n_embd // n_head, minimum=1)
    return ModelInfo(
        architecture=arch,
        block_count=n_layer,
        embedding_length=n_embd,
        head_count=n_head,
        head_count_kv=head_count_kv,
        key_length=key_length,
        value_length=keys.integer(f"{arch}.attention.value_length", default=n_embd // n_head, minimum=1),
        context_length=keys.integer(f"{arch}.context_length", minimum=1),
        vocab_size=vocab_size,
        layer_bytes=tuple(stored.layers),
        non_layer_bytes=stored.roles,
        layer_resident_bytes=tuple(resident.layers),
        non_layer_resident_bytes=resident.roles,
        output_tied="output.weight" not in header.tensor_by_name,
        cpu_resident_bytes=on_cpu,
        tensor_types=dict(Counter(tensor.ggml_type.name for tensor in header.tensors)),
        rope=_rope(keys, arch=arch, key_length=key_length),
        unsupported=_unsupported(header, arch=arch),
        sliding_window=_sliding_window(keys, arch=arch, layers=n_layer),
        expert_count=keys.integer(f"{arch}.expert_count", default=0),
        expert_used_count=keys.integer(f"{arch}.expert_used_count", default=0),
        name=keys.string("general.name"),
        tokenizer_model=keys.string("tokenizer.ggml.model"),
        tokenizer_pre=keys.string("tokenizer.ggml.pre"),
        has_chat_template=keys.get("tokenizer.chat_template") is not None,
        header_bytes=header.data_offset,
        header_bytes_read=header.bytes_fetched,
        file_bytes=file_bytes,
    )


@dataclass
class _Totals:
    """Bytes per layer (blk.N.*) and per non-layer role (the tensor name without its last part, e.g. `output`)."""

    layers: list[int]
    roles: dict[str, int] = field(default_factory=dict)

    def add(self, *, layer: int | None, role: str, count: int) -> None:
        if layer is None:
            self.roles[role] = self.roles.get(role, 0) + count
        else:
            self.layers[layer] += count


def _weight_bytes(header: GGUFHeader, *, layers: int) -> tuple[_Totals, _Totals]:
    """Weight bytes as the file stores them, and as a GPU stage holds them once loaded (strata.gguf.resident)."""
    in_file, resident = _Totals(layers=[0] * layers), _Totals(layers=[0] * layers)
    for tensor in header.tensors:
        match = _LAYER_TENSOR.match(tensor.name)
        layer = None if match is None else int(match[1])
        if layer is not None and layer >= layers:
            reason = f"layer {layer} is not below block_count {layers}"
            raise MetadataError(field=f"tensor {tensor.name!r}", offset=tensor.info_offset, reason=reason)
        role = tensor.name.rsplit(".", 1)[0] if "." in tensor.name else tensor.name
        in_file.add(layer=layer, role=role, count=tensor.nbytes)
        held = resident_bytes(tensor.ggml_type, name=tensor.name, elements=tensor.elements, stored_bytes=tensor.nbytes)
        resident.add(layer=layer, role=role, count=held)
    return in_file, resident


def _rope(keys: _Keys, *, arch: str, key_length: int) -> RopeSettings:
    original_key = f"{arch}.rope.scaling.original_context_length"
    return RopeSettings(
        freq_base=keys.number(f"{arch}.rope.freq_base") or 10000.0,
        dimension_count=keys.integer(f"{arch}.rope.dimension_count", default=key_length),
        scaling_type=keys.string(f"{arch}.rope.scaling.type"),
        scaling_factor=keys.number(f"{arch}.rope.scaling.factor"),
        original_context_length=None if keys.get(original_key) is None else keys.integer(original_key),
    )


def _unsupported(header: GGUFHeader, *, arch: str) -> str | None:
    """What the file asks of an architecture the stages run that they do not apply (strata.gguf.rope_scaling), or
    holds that they or the gateway cannot take (strata.gguf.executable.header_refusal)."""
    if arch not in ARCHITECTURES:
        return None
    return rope_scaling_refusal(
        header.metadata, architecture=ARCHITECTURES[arch], tensor_names=header.tensor_by_name
    ) or header_refusal(header.metadata, ((t.name, t.ggml_type) for t in header.tensors))


def _sliding_window(keys: _Keys, *, arch: str, layers: int) -> SlidingWindow | None:
    pattern = SLIDING_PATTERNS.get(arch)
    window = keys.integer(f"{arch}.attention.sliding_window", default=0)
    if pattern is None or window == 0:
        return None
    return SlidingWindow(window=window, layers=tuple(pattern(il) for il in range(layers)))
