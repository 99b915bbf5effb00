"""The GGUF header as the stage needs it: key/values and where each tensor's bytes lie, read through a ByteSource.

The header is parsed from growing windows of the source, so over HTTP it costs a few Range requests and never the
tensor data. Counts and lengths are bounded before anything is allocated (a GGUF file is untrusted input); a bad
file fails with ModelFileError naming the offset.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from strata.stage_worker.errors import ModelFileError
from strata.stage_worker.sources import ByteSource

MAGIC = b"GGUF"
MAX_TENSORS = 1 << 20
MAX_KEYS = 1 << 20
MAX_STRING = 1 << 26
MAX_ARRAY = 1 << 26
MAX_DIMS = 4
FIRST_WINDOW = 1 << 20

# GGUF value types: struct format of the fixed-size ones.
SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class TensorEntry:
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order (outermost first); GGUF stores the reverse
    offset: int  # absolute offset of the first byte in the file
    nbytes: int


@dataclass(frozen=True)
class Header:
    metadata: dict[str, object]
    tensors: dict[str, TensorEntry]


class _Cursor:
    """Sequential reads over a source, fetching windows that double as the header grows."""

    def __init__(self, source: ByteSource) -> None:
        self._source = source
        self._buffer = b""
        self._window = FIRST_WINDOW
        self.offset = 0

    def take(self, size: int) -> bytes:
        end = self.offset + size
        while end > len(self._buffer):
            want = max(self._window, end - len(self._buffer))
            self._buffer += self._read_available(len(self._buffer), want)
            self._window *= 2
        data = self._buffer[self.offset : end]
        self.offset = end
        return data

    def _read_available(self, offset: int, want: int) -> bytes:
        size = getattr(self._source, "size", None)
        if isinstance(size, int):
            want = min(want, size - offset)
            if want <= 0:
                raise ModelFileError(f"the header runs past the end of the file at offset {offset}")
        return self._source.read(offset, want)

    def unpack(self, fmt: str) -> object:
        value: object = struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]
        return value

    def u32(self) -> int:
        return int.from_bytes(self.take(4), "little")

    def u64(self) -> int:
        return int.from_bytes(self.take(8), "little")

    def count(self, limit: int, what: str) -> int:
        at = self.offset
        value = self.u64()
        if value > limit:
            raise ModelFileError(f"{what} at offset {at} is {value}, more than the limit of {limit}")
        return value

    def string(self) -> str:
        at = self.offset
        raw = self.take(self.count(MAX_STRING, "string length"))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ModelFileError(f"string at offset {at} is not UTF-8") from exc

    def value(self, value_type: int) -> object:
        if value_type in SCALAR_FORMATS:
            return self.unpack(SCALAR_FORMATS[value_type])
        if value_type == STRING:
            return self.string()
        if value_type == ARRAY:
            item_type = self.u32()
            n = self.count(MAX_ARRAY, "array length")
            return [self.value(item_type) for _ in range(n)]
        raise ModelFileError(f"unknown value type {value_type} at offset {self.offset - 4}")


def read_header(source: ByteSource) -> Header:
    cursor = _Cursor(source)
    if cursor.take(4) != MAGIC:
        raise ModelFileError("not a GGUF file: the magic at offset 0 is not 'GGUF'")
    version = cursor.u32()
    if version not in (2, 3):
        raise ModelFileError(f"GGUF version {version} at offset 4 is not supported (2 or 3)")
    n_tensors = cursor.count(MAX_TENSORS, "tensor count")
    n_keys = cursor.count(MAX_KEYS, "key/value count")
    metadata: dict[str, object] = {}
    for _ in range(n_keys):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.u32())
    infos: list[tuple[str, GGMLQuantizationType, tuple[int, ...], int]] = []
    for _ in range(n_tensors):
        at = cursor.offset
        name = cursor.string()
        n_dims = cursor.u32()
        if n_dims > MAX_DIMS:
            raise ModelFileError(f"tensor {name!r} at offset {at} has {n_dims} dimensions (at most {MAX_DIMS})")
        dims = tuple(cursor.u64() for _ in range(n_dims))
        raw_type = cursor.u32()
        try:
            ggml_type = GGMLQuantizationType(raw_type)
        except ValueError as exc:
            raise ModelFileError(f"tensor {name!r} at offset {at} has unknown ggml type {raw_type}") from exc
        infos.append((name, ggml_type, dims, cursor.u64()))
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or not 0 < alignment <= 1 << 16:
        raise ModelFileError(f"general.alignment {alignment!r} is not a usable alignment")
    data_start = -(-cursor.offset // alignment) * alignment
    tensors: dict[str, TensorEntry] = {}
    for name, ggml_type, dims, relative in infos:
        block_elements, block_bytes = GGML_QUANT_SIZES[ggml_type]
        elements = 1
        for d in dims:
            elements *= d
        if dims and dims[0] % block_elements:
            raise ModelFileError(f"tensor {name!r}: row of {dims[0]} values is not whole {ggml_type.name} blocks")
        tensors[name] = TensorEntry(
            name=name,
            ggml_type=ggml_type,
            shape=tuple(reversed(dims)),
            offset=data_start + relative,
            nbytes=elements // block_elements * block_bytes,
        )
    return Header(metadata=metadata, tensors=tensors)
