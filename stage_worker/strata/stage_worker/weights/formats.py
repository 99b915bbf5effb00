"""GGUF quantised blocks as a stage keeps them: each block's fields split into planes, and their reference value.

A GGUF row is a run of blocks, each of fixed size: a Q8_0 block is a float16 scale then 32 int8 values (34 bytes), a
Q4_K block a float16 scale and minimum, twelve bytes of packed 6-bit sub-scales, then 128 bytes of 4-bit values (256
values in 144 bytes). A stage keeps those bytes, not float copies of the values: a weight is a set of planes, one per
field, each a [rows, fields per row] tensor, so a kernel reads each field with aligned, contiguous loads (34-byte
blocks are not aligned for anything wider than a byte). Q4_K and Q5_K also unpack their sub-scales to one byte each
(sixteen bytes for twelve), which keeps a kernel's scale load a plain load: 148 bytes per 144 and 180 per 176.
`strata.gguf.resident` counts the same bytes; a test checks the two agree.

`dequantize` is the reference: it computes, in float32, exactly the values gguf-py's `dequantize` computes from the
file's bytes (tests compare them bit for bit). The CPU computes through it, and GPU kernels are checked against it.

Where each value sits inside a block (the bit layout) is GGUF's and is kept: ggml's quantisers wrote it, and a kernel
that knows it reads the planes as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType
from torch import Tensor

Q = GGMLQuantizationType
Planes = dict[str, Tensor]


@dataclass(frozen=True)
class Field:
    name: str
    offset: int  # bytes into the block
    size: int  # bytes in the block
    dtype: torch.dtype  # what its bytes are


@dataclass(frozen=True)
class Format:
    block_elements: int
    block_bytes: int  # in the file
    fields: tuple[Field, ...]
    values: Callable[[Planes, int], Tensor]  # planes, rows -> [rows, blocks, block_elements] float32
    unpack: Callable[[Planes], Planes] | None = None  # planes as split -> planes as kept

    def resident_block_bytes(self) -> int:
        return self.block_bytes + (4 if self.unpack is not None else 0)


def _nibbles(qs: Tensor, rows: int, *, block: int, groups: int = 1) -> Tensor:
    """4-bit values of blocks of `block` bytes whose bytes hold value j in the low nibble and value j + half in the
    high one, per group of 2 x half values: [rows, blocks x block] uint8 -> [rows, blocks, 2 x block] int32."""
    q = qs.view(rows, -1, groups, 1, block // groups).to(torch.int32)
    return torch.cat((q & 0x0F, q >> 4), dim=3).reshape(rows, q.shape[1], -1)


def _bits(qh: Tensor, rows: int) -> Tensor:
    """Q5_0/Q5_1's fifth bits: 4 bytes a block, bit i of the little-endian word is value i's. -> [rows, blocks, 32]."""
    q = qh.view(rows, -1, 4).to(torch.int32)
    word = q[..., 0] | (q[..., 1] << 8) | (q[..., 2] << 16) | (q[..., 3] << 24)
    return (word[..., None] >> torch.arange(32, device=qh.device, dtype=torch.int32)) & 1


def _scale(planes: Planes, rows: int, name: str = "d") -> Tensor:
    return planes[name].view(rows, -1, 1).float()


def _q8_0(p: Planes, rows: int) -> Tensor:
    return p["qs"].view(rows, -1, 32).float() * _scale(p, rows)


def _q4_0(p: Planes, rows: int) -> Tensor:
    return (_nibbles(p["qs"], rows, block=16) - 8).float() * _scale(p, rows)


def _q4_1(p: Planes, rows: int) -> Tensor:
    return _nibbles(p["qs"], rows, block=16).float() * _scale(p, rows) + _scale(p, rows, "m")


def _q5_0(p: Planes, rows: int) -> Tensor:
    q = _nibbles(p["qs"], rows, block=16) | (_bits(p["qh"], rows) << 4)
    return (q - 16).float() * _scale(p, rows)


def _q5_1(p: Planes, rows: int) -> Tensor:
    q = _nibbles(p["qs"], rows, block=16) | (_bits(p["qh"], rows) << 4)
    return q.float() * _scale(p, rows) + _scale(p, rows, "m")


def _k_scales(p: Planes, rows: int) -> tuple[Tensor, Tensor]:
    """Q4_K/Q5_K: each 32-value sub-block's scale d x sc and minimum dmin x m, float32 [rows, blocks, 8, 1]."""
    d = p["d"].view(rows, -1, 1, 1).float()
    dmin = p["dmin"].view(rows, -1, 1, 1).float()
    sc = p["sc"].view(rows, -1, 8, 1).float()
    m = p["m"].view(rows, -1, 8, 1).float()
    return d * sc, dmin * m


def _q4_k(p: Planes, rows: int) -> Tensor:
    scale, minimum = _k_scales(p, rows)
    q = _nibbles(p["qs"], rows, block=128, groups=4).view(rows, -1, 8, 32).float()
    return (scale * q - minimum).view(rows, -1, 256)


def _q5_k(p: Planes, rows: int) -> Tensor:
    scale, minimum = _k_scales(p, rows)
    low = _nibbles(p["qs"], rows, block=128, groups=4).view(rows, -1, 8, 32)
    shifts = torch.arange(8, device=p["qh"].device, dtype=torch.int32).view(1, 1, 8, 1)
    high = (p["qh"].view(rows, -1, 1, 32).to(torch.int32) >> shifts) & 1  # value 32 j + l: bit j of qh[l]
    return (scale * (low | (high << 4)).float() - minimum).view(rows, -1, 256)


def _q6_k(p: Planes, rows: int) -> Tensor:
    # Value 128 h + 32 s + l: the low 4 bits from ql[64 h + 32 (s mod 2) + l] (nibble s div 2), the high 2 bits from
    # qh[32 h + l] (bits 2 s); each 16 values share one int8 scale.
    low = _nibbles(p["ql"], rows, block=128, groups=2)  # [rows, blocks, 256] in value order
    shifts = 2 * torch.arange(4, device=p["qh"].device, dtype=torch.int32).view(1, 1, 1, 4, 1)
    high = (p["qh"].view(rows, -1, 2, 1, 32).to(torch.int32) >> shifts) & 3
    q = (low | (high.reshape(rows, -1, 256) << 4)) - 32
    scales = p["sc"].view(rows, -1, 16, 1).float() * p["d"].view(rows, -1, 1, 1).float()
    return (scales * q.view(rows, -1, 16, 16).float()).view(rows, -1, 256)


def _unpack_k_scales(p: Planes) -> Planes:
    """Q4_K/Q5_K: twelve bytes of 6-bit scales and minimums -> sc and m, one byte each (llama.cpp's get_scale_min_k4).

    Bytes 0-3 hold the low 6 bits of scales 0-3, bytes 4-7 of minimums 0-3; bytes 8-11 hold the low 4 bits of
    scales 4-7 (low nibble) and minimums 4-7 (high nibble), whose top 2 bits are the top bits of bytes 0-3 / 4-7.
    """
    rows = p["scales"].shape[0]
    s = p.pop("scales").view(rows, -1, 3, 4).to(torch.int32)
    low, high, extra = s[:, :, 0], s[:, :, 1], s[:, :, 2]  # [rows, blocks, 4] each
    sc = torch.cat((low & 63, (extra & 15) | ((low >> 6) << 4)), dim=-1)
    m = torch.cat((high & 63, (extra >> 4) | ((high >> 6) << 4)), dim=-1)
    p["sc"] = sc.to(torch.uint8).reshape(rows, -1)
    p["m"] = m.to(torch.uint8).reshape(rows, -1)
    return p


F16, U8, I8 = torch.float16, torch.uint8, torch.int8
FORMATS: dict[GGMLQuantizationType, Format] = {
    Q.Q8_0: Format(32, 34, (Field("d", 0, 2, F16), Field("qs", 2, 32, I8)), _q8_0),
    Q.Q4_0: Format(32, 18, (Field("d", 0, 2, F16), Field("qs", 2, 16, U8)), _q4_0),
    Q.Q4_1: Format(32, 20, (Field("d", 0, 2, F16), Field("m", 2, 2, F16), Field("qs", 4, 16, U8)), _q4_1),
    Q.Q5_0: Format(32, 22, (Field("d", 0, 2, F16), Field("qh", 2, 4, U8), Field("qs", 6, 16, U8)), _q5_0),
    Q.Q5_1: Format(
        32, 24, (Field("d", 0, 2, F16), Field("m", 2, 2, F16), Field("qh", 4, 4, U8), Field("qs", 8, 16, U8)), _q5_1
    ),
    Q.Q4_K: Format(
        256,
        144,
        (Field("d", 0, 2, F16), Field("dmin", 2, 2, F16), Field("scales", 4, 12, U8), Field("qs", 16, 128, U8)),
        _q4_k,
        _unpack_k_scales,
    ),
    Q.Q5_K: Format(
        256,
        176,
        (
            Field("d", 0, 2, F16),
            Field("dmin", 2, 2, F16),
            Field("scales", 4, 12, U8),
            Field("qh", 16, 32, U8),
            Field("qs", 48, 128, U8),
        ),
        _q5_k,
        _unpack_k_scales,
    ),
    Q.Q6_K: Format(
        256,
        210,
        (Field("ql", 0, 128, U8), Field("qh", 128, 64, U8), Field("sc", 192, 16, I8), Field("d", 208, 2, F16)),
        _q6_k,
    ),
}


def plane_names(ggml_type: GGMLQuantizationType) -> tuple[str, ...]:
    """The planes of a type in the order `split_planes` makes them (kernels take them as a list in this order)."""
    fmt = FORMATS[ggml_type]
    names = tuple(f.name for f in fmt.fields if f.name != "scales")
    return names + (("sc", "m") if fmt.unpack is not None else ())


def split_planes(raw: Tensor, ggml_type: GGMLQuantizationType, *, rows: int) -> Planes:
    """A tensor's bytes as stored ([rows x row bytes] uint8, on any device) -> its planes, on that device."""
    fmt = FORMATS[ggml_type]
    blocks = raw.view(rows, -1, fmt.block_bytes)
    planes = {
        f.name: blocks[:, :, f.offset : f.offset + f.size].contiguous().view(f.dtype).reshape(rows, -1)
        for f in fmt.fields
    }
    return fmt.unpack(planes) if fmt.unpack is not None else planes


def dequantize(planes: Planes, ggml_type: GGMLQuantizationType) -> Tensor:
    """[rows, columns] float32: the values the planes hold, computed as gguf-py computes them."""
    rows = next(iter(planes.values())).shape[0]
    return FORMATS[ggml_type].values(planes, rows).reshape(rows, -1)


def planes_bytes(planes: Planes) -> int:
    return sum(p.numel() * p.element_size() for p in planes.values())
