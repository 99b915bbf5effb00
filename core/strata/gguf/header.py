"""The raw GGUF header: magic, version, key/values and tensor infos, decoded from any byte source.

This is the one place that knows the byte layout. It reads through a cursor that asks the source for a window of
bytes at a time and doubles the window each time it runs out, so a local file and an HTTP Range source both cost
about the header's size whatever the file's size. Every count and length is bounded (limits.py) before it is used.
Format constants come from gguf-py (GGUFValueType, GGMLQuantizationType, GGML_QUANT_SIZES).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from strata.gguf.cursor import ByteSource, Cursor
from strata.gguf.errors import (
    BadMagicError,
    DuplicateKeyError,
    InvalidValueError,
    LimitExceededError,
    MisalignedTensorError,
    TooManyDimsError,
    UnknownTensorTypeError,
    UnsupportedVersionError,
)
from strata.gguf.limits import DEFAULT_LIMITS, Limits
from strata.gguf.values import Value, read_value

SUPPORTED_VERSIONS = (2, 3)  # v1 used 32-bit counts; nothing in use still writes it
ALIGNMENT_KEY = "general.alignment"


@dataclass(frozen=True, kw_only=True)
class TensorInfo:
    """Where one tensor's data lives: `offset` is absolute in the file, `dims` in ggml order (fastest first)."""

    name: str
    ggml_type: GGMLQuantizationType
    dims: tuple[int, ...]
    offset: int
    nbytes: int
    info_offset: int = 0  # where this tensor's info record starts in the header

    @property
    def shape(self) -> tuple[int, ...]:
        """Row-major (numpy/torch) order: the reverse of ggml's."""
        return tuple(reversed(self.dims))

    @property
    def elements(self) -> int:
        total = 1
        for dim in self.dims:
            total *= dim
        return total


@dataclass(frozen=True, kw_only=True)
class GGUFHeader:
    version: int
    metadata: dict[str, Value]
    value_types: dict[str, GGUFValueType]
    key_offsets: dict[str, int]
    tensors: tuple[TensorInfo, ...]
    alignment: int
    tensor_info_end: int  # first byte after the tensor infos
    data_offset: int  # start of the tensor data: tensor_info_end rounded up to the alignment
    bytes_fetched: int = 0
    requests: int = 0
    tensor_by_name: dict[str, TensorInfo] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.tensor_by_name.update({t.name: t for t in self.tensors})


def read_header(source: ByteSource, *, limits: Limits = DEFAULT_LIMITS) -> GGUFHeader:
    """Decode the header of `source`; raises a GGUFFormatError subclass naming the field and offset on bad input."""
    cursor = Cursor(source, limits=limits)
    magic = cursor.u32(field="magic")
    if magic != GGUF_MAGIC:
        raise BadMagicError(field="magic", offset=0, reason=f"expected b'GGUF', found {struct.pack('<I', magic)!r}")
    version = cursor.u32(field="version")
    if version not in SUPPORTED_VERSIONS:
        hint = " (a big-endian file?)" if struct.pack("<I", version)[::-1] in (b"\0\0\0\2", b"\0\0\0\3") else ""
        raise UnsupportedVersionError(field="version", offset=4, reason=f"version {version} is not 2 or 3{hint}")
    tensor_count = cursor.count(field="tensor_count", limit=limits.max_tensor_count, min_item_bytes=24)
    kv_count = cursor.count(field="kv_count", limit=limits.max_kv_count, min_item_bytes=12)
    metadata: dict[str, Value] = {}
    value_types: dict[str, GGUFValueType] = {}
    key_offsets: dict[str, int] = {}
    for index in range(kv_count):
        offset = cursor.pos
        key = cursor.string(field=f"kv[{index}].key")
        if key in metadata:
            raise DuplicateKeyError(field=f"kv[{index}].key", offset=offset, reason=f"key {key!r} appears twice")
        value_types[key], metadata[key] = read_value(cursor, field=key)
        key_offsets[key] = offset
    alignment = _alignment(metadata, value_types, key_offsets)
    tensors = _read_tensor_infos(cursor, count=tensor_count, alignment=alignment)
    tensor_info_end = cursor.pos
    data_offset = -(-tensor_info_end // alignment) * alignment
    return GGUFHeader(
        version=version,
        metadata=metadata,
        value_types=value_types,
        key_offsets=key_offsets,
        tensors=tuple(TensorInfo(**{**vars(t), "offset": t.offset + data_offset}) for t in tensors),
        alignment=alignment,
        tensor_info_end=tensor_info_end,
        data_offset=data_offset,
        bytes_fetched=cursor.bytes_fetched,
        requests=cursor.requests,
    )


def _alignment(metadata: dict[str, Value], types: dict[str, GGUFValueType], offsets: dict[str, int]) -> int:
    if ALIGNMENT_KEY not in metadata:
        return int(GGUF_DEFAULT_ALIGNMENT)
    value = metadata[ALIGNMENT_KEY]
    unsigned = (GGUFValueType.UINT8, GGUFValueType.UINT16, GGUFValueType.UINT32, GGUFValueType.UINT64)
    if types[ALIGNMENT_KEY] not in unsigned or not isinstance(value, int) or value <= 0 or value & (value - 1):
        raise InvalidValueError(
            field=ALIGNMENT_KEY, offset=offsets[ALIGNMENT_KEY], reason=f"{value!r} is not a power-of-two integer"
        )
    if value > 1 << 20:
        raise LimitExceededError(field=ALIGNMENT_KEY, offset=offsets[ALIGNMENT_KEY], reason=f"{value} exceeds 1 MiB")
    return value


def _read_tensor_infos(cursor: Cursor, *, count: int, alignment: int) -> list[TensorInfo]:
    """Tensor infos with offsets still relative to the data section; each checked for type, shape and alignment."""
    limits = cursor.limits
    tensors: list[TensorInfo] = []
    names: set[str] = set()
    previous_end = 0
    for index in range(count):
        start = cursor.pos
        name = cursor.string(field=f"tensor[{index}].name")
        label = f"tensor[{index}] {name!r}"
        if name in names:
            raise DuplicateKeyError(field=f"{label}.name", offset=start, reason="tensor name appears twice")
        names.add(name)
        dims_offset = cursor.pos
        n_dims = cursor.u32(field=f"{label}.n_dims")
        if n_dims > limits.max_dims:
            raise TooManyDimsError(field=f"{label}.n_dims", offset=dims_offset, reason=f"{n_dims} > {limits.max_dims}")
        dims = tuple(cursor.u64(field=f"{label}.dims[{axis}]") for axis in range(n_dims))
        elements = 1
        for dim in dims:
            elements *= dim
            if elements > limits.max_tensor_elements:
                raise LimitExceededError(field=f"{label}.dims", offset=dims_offset, reason=f"shape {dims} is too large")
        type_offset = cursor.pos
        raw_type = cursor.u32(field=f"{label}.type")
        try:
            ggml_type = GGMLQuantizationType(raw_type)
            block_elements, block_bytes = GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise UnknownTensorTypeError(field=f"{label}.type", offset=type_offset, reason=f"type {raw_type}") from None
        if dims and dims[0] % block_elements:
            raise InvalidValueError(
                field=f"{label}.dims", offset=dims_offset, reason=f"row of {dims[0]} not a multiple of {block_elements}"
            )
        offset_at = cursor.pos
        offset = cursor.u64(field=f"{label}.offset")
        if offset % alignment or offset < previous_end:
            reason = (
                f"offset {offset} is not a multiple of {alignment}"
                if offset % alignment
                else f"offset {offset} overlaps the previous tensor, which ends at {previous_end}"
            )
            raise MisalignedTensorError(field=f"{label}.offset", offset=offset_at, reason=reason)
        nbytes = elements // block_elements * block_bytes
        previous_end = offset + nbytes
        tensors.append(
            TensorInfo(name=name, ggml_type=ggml_type, dims=dims, offset=offset, nbytes=nbytes, info_offset=start)
        )
    return tensors
