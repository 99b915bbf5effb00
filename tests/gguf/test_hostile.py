"""Hostile headers, built byte by byte, fail with typed errors naming the field and offset, in bounded memory."""

from __future__ import annotations

import contextlib
import os
import struct
import tracemalloc

import pytest
from gguf import GGMLQuantizationType, GGUFValueType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strata.gguf import GGUFError, GGUFFormatError, describe, read_header
from strata.gguf import errors as e

U32, U64, STR, ARR = GGUFValueType.UINT32, GGUFValueType.UINT64, GGUFValueType.STRING, GGUFValueType.ARRAY
F32, Q8_0 = GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0


class BytesSource:
    name = "memory"

    def __init__(self, data: bytes) -> None:
        self.data = data

    def read(self, offset: int, length: int) -> bytes:
        return self.data[offset : offset + length]


def text(value: str | bytes, *, length: int | None = None) -> bytes:
    raw = value.encode() if isinstance(value, str) else value
    return struct.pack("<Q", len(raw) if length is None else length) + raw


def kv(key: str, value_type: int, payload: bytes) -> bytes:
    return text(key) + struct.pack("<I", value_type) + payload


def u32(key: str, value: int) -> bytes:
    return kv(key, U32, struct.pack("<I", value))


def tensor(name: str, dims: tuple[int, ...], ggml_type: int, offset: int) -> bytes:
    return text(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ggml_type, offset)


def header(kvs: list[bytes], tensors: list[bytes], *, magic: bytes = b"GGUF", version: int = 3) -> bytes:
    counts = struct.pack("<IQQ", version, len(tensors), len(kvs))
    return magic + counts + b"".join(kvs) + b"".join(tensors)


GOOD_KVS = [
    kv("general.architecture", STR, text("llama")),
    u32("llama.block_count", 1),
    u32("llama.embedding_length", 64),
    u32("llama.attention.head_count", 2),
    u32("llama.context_length", 128),
    kv("tokenizer.ggml.tokens", ARR, struct.pack("<IQ", STR, 2) + text("a") + text("b")),
]
GOOD_TENSORS = [tensor("blk.0.attn_norm.weight", (64,), F32, 0), tensor("output.weight", (64, 2), Q8_0, 256)]
GOOD = header(GOOD_KVS, GOOD_TENSORS)
KV_START = 24
TENSORS_START = len(header(GOOD_KVS, []))


def bad_count(at: int, value: int) -> bytes:
    return GOOD[:at] + struct.pack("<Q", value) + GOOD[at + 8 :]


CASES = [
    pytest.param(header(GOOD_KVS, GOOD_TENSORS, magic=b"GGML"), e.BadMagicError, "magic", 0, id="wrong magic"),
    pytest.param(header(GOOD_KVS, [], version=1), e.UnsupportedVersionError, "version", 4, id="version 1 is refused"),
    pytest.param(
        header(GOOD_KVS, [], version=3 << 24), e.UnsupportedVersionError, "version", 4, id="a big-endian file"
    ),
    pytest.param(bad_count(8, 2**60), e.LimitExceededError, "tensor_count", 8, id="2^60 tensors are refused"),
    pytest.param(bad_count(16, 2**60), e.LimitExceededError, "kv_count", 16, id="2^60 key/values are refused"),
    pytest.param(
        header([text("k", length=2**30)], []), e.LimitExceededError, "kv[0].key length", 24, id="a 1 GB key"
    ),
    pytest.param(
        header([kv("k", STR, text("v", length=2**30))], []),
        e.LimitExceededError, "k length", 24 + 9 + 4, id="a 1 GB string value is refused before it is fetched",
    ),
    pytest.param(
        header([kv("k", ARR, struct.pack("<IQ", U32, 2**60))], []),
        e.LimitExceededError, "k.count", 24 + 9 + 8, id="an array of 2^60 integers",
    ),
    pytest.param(
        header([kv("k", ARR, struct.pack("<IQ", STR, 2**60))], []),
        e.LimitExceededError, "k.count", 24 + 9 + 8, id="an array of 2^60 strings",
    ),
    pytest.param(
        header([u32("k", 1), u32("k", 2)], []), e.DuplicateKeyError, "kv[1].key", 24 + 17, id="a duplicate key"
    ),
    pytest.param(header([kv("k", 99, b"")], []), e.UnknownValueTypeError, "k.type", 24 + 9, id="value type 99"),
    pytest.param(
        header([kv("k", ARR, struct.pack("<IQ", ARR, 1))], []),
        e.UnknownValueTypeError, "k.element_type", 24 + 13, id="an array of arrays",
    ),
    pytest.param(
        header([kv("general.alignment", U32, struct.pack("<I", 24))], []),
        e.InvalidValueError, "general.alignment", 24, id="an alignment that is not a power of two",
    ),
    pytest.param(
        header([kv("k", U32, b"\0\0")], []), e.TruncatedError, "k", 24 + 9 + 4, id="a value cut short",
    ),
    pytest.param(
        header([text(b"\xff\xfe") + struct.pack("<I", U32) + b"\0" * 4], []),
        e.InvalidValueError, "kv[0].key", 24, id="a key that is not UTF-8",
    ),
    pytest.param(
        header(GOOD_KVS, [tensor("t", (64,), 99, 0)]),
        e.UnknownTensorTypeError, "tensor[0] 't'.type", TENSORS_START + 9 + 4 + 8, id="tensor type 99",
    ),
    pytest.param(
        header(GOOD_KVS, [tensor("t", (64,), F32, 7)]),
        e.MisalignedTensorError, "tensor[0] 't'.offset", TENSORS_START + 9 + 4 + 8 + 4, id="offset 7 is misaligned",
    ),
    pytest.param(
        header(GOOD_KVS, [tensor("a", (64,), F32, 0), tensor("b", (64,), F32, 128)]),
        e.MisalignedTensorError, "tensor[1] 'b'.offset", TENSORS_START + 2 * 33 - 8, id="overlapping tensors",
    ),
    pytest.param(
        header(GOOD_KVS, [tensor("t", (1, 1, 1, 1, 1), F32, 0)]),
        e.TooManyDimsError, "tensor[0] 't'.n_dims", TENSORS_START + 9, id="five dimensions",
    ),
    pytest.param(
        header(GOOD_KVS, [tensor("t", (2**40, 2**40), F32, 0)]),
        e.LimitExceededError, "tensor[0] 't'.dims", TENSORS_START + 9, id="a shape with 2^80 elements",
    ),
    pytest.param(
        header(GOOD_KVS, [tensor("t", (33,), Q8_0, 0)]),
        e.InvalidValueError, "tensor[0] 't'.dims", TENSORS_START + 9, id="a Q8_0 row of 33 values",
    ),
    pytest.param(
        header(GOOD_KVS, [tensor("t", (64,), F32, 0), tensor("t", (64,), F32, 256)]),
        e.DuplicateKeyError, "tensor[1] 't'.name", TENSORS_START + 33, id="a duplicate tensor name",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("data", "error", "field", "offset"), CASES)
def test_hostile_headers_raise_typed_errors_naming_field_and_offset(
    data: bytes, error: type[GGUFFormatError], field: str, offset: int
) -> None:
    tracemalloc.start()
    with pytest.raises(error) as raised:
        read_header(BytesSource(data))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert (raised.value.field, raised.value.offset) == (field, offset)
    assert f"at byte {offset}" in str(raised.value)
    assert peak < 4 * 2**20


def test_the_well_formed_header_reads_and_describes() -> None:
    parsed = read_header(BytesSource(GOOD))
    assert [t.name for t in parsed.tensors] == ["blk.0.attn_norm.weight", "output.weight"]
    assert describe(parsed).vocab_size == 2


def test_a_cut_anywhere_inside_the_header_is_a_truncation() -> None:
    for end in range(len(GOOD)):
        with pytest.raises(e.TruncatedError) as raised:
            read_header(BytesSource(GOOD[:end]))
        assert raised.value.offset <= end


mutations = st.lists(
    st.tuples(st.integers(0, len(GOOD) - 1), st.sampled_from([0, 1, 7, 0x20, 0x7F, 0x80, 0xFF])),
    min_size=1,
    max_size=6,
)


@settings(
    max_examples=int(os.environ.get("STRATA_FUZZ_EXAMPLES", "300")),
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(mutations=mutations, cut=st.integers(len(GOOD) // 2, len(GOOD)))
def test_mutated_headers_raise_only_typed_errors(mutations: list[tuple[int, int]], cut: int) -> None:
    data = bytearray(GOOD)
    for position, value in mutations:
        data[position] = value
    with contextlib.suppress(GGUFError):
        describe(read_header(BytesSource(bytes(data[:cut]))))
