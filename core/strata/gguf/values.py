"""Decoding one GGUF metadata value: the scalar types, strings, and arrays of either.

Arrays are bounded by count and by the bytes their elements need before anything is read; fixed-width arrays are
unpacked in one call. Arrays of arrays are refused: llama.cpp does not read them either, and no model writes them.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from gguf import GGUFValueType
from strata.gguf.errors import LimitExceededError, UnknownValueTypeError

if TYPE_CHECKING:
    from strata.gguf.cursor import Cursor

Scalar = int | float | bool | str
Value = Scalar | tuple[Scalar, ...]

# struct format of each fixed-width type (all little-endian)
FIXED_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}


def read_value_type(cursor: Cursor, *, field: str) -> GGUFValueType:
    offset = cursor.pos
    raw = cursor.u32(field=field)
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise UnknownValueTypeError(field=field, offset=offset, reason=f"value type {raw}") from None


def read_value(cursor: Cursor, *, field: str) -> tuple[GGUFValueType, Value]:
    """The type tag and value of the key/value `field` (the cursor sits on its type tag)."""
    value_type = read_value_type(cursor, field=f"{field}.type")
    if value_type == GGUFValueType.ARRAY:
        return value_type, _read_array(cursor, field=field)
    return value_type, _read_scalar(cursor, value_type, field=field)


def _read_scalar(cursor: Cursor, value_type: GGUFValueType, *, field: str) -> Scalar:
    if value_type == GGUFValueType.STRING:
        return cursor.string(field=field, errors="surrogateescape")
    value = cursor.unpack(FIXED_FORMATS[value_type], field=field)[0]
    return bool(value) if value_type == GGUFValueType.BOOL else value


def _read_array(cursor: Cursor, *, field: str) -> tuple[Scalar, ...]:
    type_offset = cursor.pos
    element_type = read_value_type(cursor, field=f"{field}.element_type")
    if element_type == GGUFValueType.ARRAY:
        raise UnknownValueTypeError(field=f"{field}.element_type", offset=type_offset, reason="arrays of arrays")
    if element_type == GGUFValueType.STRING:
        count = cursor.count(field=f"{field}.count", limit=cursor.limits.max_array_count, min_item_bytes=8)
        return tuple(cursor.string(field=f"{field}[{i}]", errors="surrogateescape") for i in range(count))
    fmt = FIXED_FORMATS[element_type]
    width = struct.calcsize("<" + fmt)
    count_offset = cursor.pos
    count = cursor.count(field=f"{field}.count", limit=cursor.limits.max_array_count, min_item_bytes=width)
    if count * width > cursor.limits.max_header_bytes:
        raise LimitExceededError(field=f"{field}.count", offset=count_offset, reason=f"{count} elements is too many")
    values = cursor.unpack(f"{count}{fmt}", field=field)
    if element_type == GGUFValueType.BOOL:
        return tuple(bool(v) for v in values)
    return values
