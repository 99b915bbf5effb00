"""The model's matrices as a stage holds them: rows kept in their GGUF blocks, or plain values where the file has them.

A matrix of the model may stack several GGUF tensors (q/k/v, gate/up), and a Q4_K_M file gives them different types
(attn_v and ffn_down are often Q6_K beside Q4_K). So a `PackedLinear` is a list of parts, each a run of rows of one
type: `QuantizedRows` keep the file's blocks as planes (strata.stage_worker.weights.formats) and multiply through
the quantised-matmul op (a fused kernel on GPUs, the reference dequantise-then-matmul elsewhere); `DenseRows` hold
plain values in the compute dtype (F16, BF16, F32, and the types a stage does not keep quantised). Each part's output
is a slice of the layer's output columns.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from strata.stage_worker.kernels.quant_matmul import (
    FUSED_TYPES,
    GATED_MIN_ROWS,
    NORMED_TYPES,
    Gate,
    dequantize_as,
    kernel,
    kernel_normed,
    quant_linear,
)
from strata.stage_worker.weights.formats import Planes, dequantize, plane_names
from torch import Tensor, nn


class QuantizedRows(nn.Module):
    """Rows of a matrix in one GGUF block type, as planes (buffers, so `.to()` and state dicts see them)."""

    def __init__(self, planes: Planes, ggml_type: GGMLQuantizationType, *, columns: int) -> None:
        super().__init__()
        self.ggml_type = ggml_type
        self.columns = columns
        self.names = plane_names(ggml_type)
        for name in self.names:
            self.register_buffer(name, planes[name])
        self.rows = planes[self.names[0]].shape[0]

    def planes(self) -> list[Tensor]:
        return [self.get_buffer(name) for name in self.names]

    def matmul(self, x: Tensor) -> Tensor:
        return quant_linear(x, self.planes(), self.ggml_type, columns=self.columns)

    def matmul_gated(self, gate_up: Tensor, gate: Gate) -> Tensor:
        """act(gate) * up @ W.T of a gated feed-forward's [M, 2K] gate and up, the activation formed in the
        kernel's load of x (CUDA only: see PackedLinear.forms_gate)."""
        return kernel(gate_up, self.planes(), self.ggml_type, columns=self.columns, gate=gate)

    def matmul_activated(self, x: Tensor, activate: Gate) -> Tensor:
        """act(gate) * up of x @ W.T, W a gated feed-forward's gate rows over its up rows, the activation formed as
        the kernel stores (CUDA only: see PackedLinear.activates)."""
        return kernel(x, self.planes(), self.ggml_type, columns=self.columns, activate=activate)

    def matmul_normed(
        self, x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, activate: Gate = Gate.NONE
    ) -> tuple[Tensor, Tensor]:
        """(rms_norm(h) * weight @ W.T, h) with h = x (+ residual), the norm formed in the kernel's load of x (CUDA
        only: see PackedLinear.takes_norm); with `activate`, act(gate) * up of the product's gate and up halves."""
        return kernel_normed(x, residual, self.planes(), self.ggml_type, columns=self.columns, weight=weight, eps=eps,
                             activate=activate)  # fmt: skip

    def dense(self, dtype: torch.dtype) -> Tensor:
        """[rows, columns] values in `dtype` (for prefill-sized work and references)."""
        return dequantize_as(dict(zip(self.names, self.planes(), strict=True)), self.ggml_type, dtype)

    def lookup(self, index: Tensor, dtype: torch.dtype) -> Tensor:
        """Rows `index` only, dequantised: an embedding lookup reads the blocks of the tokens it needs."""
        planes = {name: plane[index] for name, plane in zip(self.names, self.planes(), strict=True)}
        return dequantize(planes, self.ggml_type).to(dtype)


class DenseRows(nn.Module):
    """Rows of a matrix as plain values in the compute dtype."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.rows = weight.shape[0]

    def matmul(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)

    def dense(self, dtype: torch.dtype) -> Tensor:
        return self.weight.to(dtype)

    def lookup(self, index: Tensor, dtype: torch.dtype) -> Tensor:
        return self.weight[index].to(dtype)


Rows = QuantizedRows | DenseRows


class PackedLinear(nn.Module):
    """y = x W^T (+ b), W the parts' rows stacked in order."""

    def __init__(self, parts: Sequence[Rows], *, bias: Tensor | None = None) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_features = sum(part.rows for part in parts)

    def forward(self, x: Tensor) -> Tensor:
        return joined(self.pieces(x))

    def pieces(self, x: Tensor) -> list[Tensor]:
        """y by part, [..., part.rows] each (the bias added): a caller that splits y's columns anyway (q, k and v)
        takes views of these (`split_columns`) where joining them first would copy every column once more."""
        return self._biased([part.matmul(x) for part in self.parts])  # type: ignore[operator]

    def _biased(self, outs: list[Tensor]) -> list[Tensor]:
        if self.bias is None:
            return outs
        bounds = itertools.pairwise([0, *itertools.accumulate(out.shape[-1] for out in outs)])
        return [out + self.bias[start:end] for out, (start, end) in zip(outs, bounds, strict=True)]

    def forms_gate(self, gate_up: Tensor) -> bool:
        """Whether `gated` can take a gated feed-forward's gate and up as they are: one quantised part that the
        kernels read, no bias, on a GPU, and rows enough for the tensor-core kernel (quant_matmul.GATED_MIN_ROWS)."""
        part = self.parts[0]
        return (
            gate_up.device.type == "cuda"
            and gate_up.numel() // gate_up.shape[-1] >= GATED_MIN_ROWS
            and len(self.parts) == 1
            and self.bias is None
            and isinstance(part, QuantizedRows)
            and part.ggml_type in FUSED_TYPES
        )

    def gated(self, gate_up: Tensor, gate: Gate) -> Tensor:
        """[M, 2K] gate and up -> act(gate) * up @ W.T [M, N], where `forms_gate` says so."""
        part = self.parts[0]
        if not isinstance(part, QuantizedRows):
            raise TypeError("a gated product needs a matrix of one quantised part (PackedLinear.forms_gate)")
        rows = gate_up.reshape(-1, gate_up.shape[-1])
        return part.matmul_gated(rows, gate).view(*gate_up.shape[:-1], self.out_features)

    def takes_norm(self, x: Tensor) -> bool:
        """Whether `normed` forms the norm before this matrix: one stream's decode step [1, K] on a GPU, every part
        quantised in a type where that measured faster (quant_matmul.NORMED_TYPES; the kernel reads every fused type).

        One row only, for now: on an H100 (2026-11-27) a 3-stream step of a Q4_K model decoded otherwise than with the
        norms apart (tests/gpu/test_decode_step_gpu.py; Q8_0 with 3 streams and Q4_K with one agreed), and no lease
        was left to find out why. The kernel takes up to FUSED_MAX_ROWS rows, and its CPU checks pass for them."""
        return (
            x.device.type == "cuda"
            and x.dim() == 2
            and x.shape[0] == 1
            and all(isinstance(part, QuantizedRows) and part.ggml_type in NORMED_TYPES for part in self.parts)
        )

    def activates(self, x: Tensor) -> bool:
        """Whether `activation` (and `normed_activation`, where `takes_norm` says so too) can take this matrix as a
        gated feed-forward's gate rows over its up rows: one stream's decode step [1, K] on a GPU (as `takes_norm`,
        one row for now), one quantised part of a type the kernels read, no bias."""
        part = self.parts[0]
        return (
            x.device.type == "cuda"
            and x.dim() == 2
            and x.shape[0] == 1
            and len(self.parts) == 1
            and self.bias is None
            and isinstance(part, QuantizedRows)
            and part.ggml_type in FUSED_TYPES
            and self.out_features % 2 == 0
        )

    def activation(self, x: Tensor, activate: Gate) -> Tensor:
        """act(gate) * up of x @ W.T [M, N / 2], formed as the product stores its outputs, where `activates` says
        so: the activation was a compiled kernel of its own a layer."""
        return self._activated_part().matmul_activated(x, activate)

    def normed_activation(
        self, x: Tensor, residual: Tensor | None, *, weight: Tensor, eps: float, activate: Gate
    ) -> tuple[Tensor, Tensor]:
        """(act(gate) * up of rms_norm(h) * weight @ W.T, h), where `activates` and `takes_norm` say so: the add,
        the norm, gate/up and the activation of a decode step's feed-forward in one launch."""
        return self._activated_part().matmul_normed(x, residual, weight, eps, activate)

    def _activated_part(self) -> QuantizedRows:
        part = self.parts[0]
        if not isinstance(part, QuantizedRows) or len(self.parts) > 1 or self.bias is not None:
            raise TypeError("an activated product needs a matrix of one quantised part (PackedLinear.activates)")
        return part

    def normed(self, x: Tensor, residual: Tensor | None, *, weight: Tensor, eps: float) -> tuple[list[Tensor], Tensor]:
        """(rms_norm(h) * weight @ W.T (+ b) by part, as `pieces`, and h) with h = x (+ residual), where `takes_norm`
        says so. The first part forms h; the others norm it again (each program of a kernel needs the whole row's
        squares)."""
        first, *rest = self.parts
        if not isinstance(first, QuantizedRows):
            raise TypeError("a normed product needs quantised parts (PackedLinear.takes_norm)")
        out, h = first.matmul_normed(x, residual, weight, eps)
        outs = [out] + [part.matmul_normed(h, None, weight, eps)[0] for part in rest]  # type: ignore[operator]
        return self._biased(outs), h

    def dense(self, dtype: torch.dtype) -> Tensor:
        """W as plain values [out_features, in_features] (references, and HF built from a stage)."""
        return torch.cat([part.dense(dtype) for part in self.parts])  # type: ignore[operator]


def joined(pieces: Sequence[Tensor]) -> Tensor:
    """Column pieces as one tensor (the one piece itself, uncopied)."""
    return pieces[0] if len(pieces) == 1 else torch.cat(list(pieces), dim=-1)


def split_columns(pieces: Sequence[Tensor], sizes: Sequence[int]) -> list[Tensor]:
    """The columns of `pieces` joined, cut into runs of `sizes`: a run inside one piece is a view of it, and only a
    run across pieces is copied (joined). Where a Q4_K_M file stores attn_v as Q6_K beside a Q4_K attn_q and attn_k,
    q and k are views of one piece and v is the other, where joining all three first cost copies a layer."""
    widths = [piece.shape[-1] for piece in pieces]
    if sum(widths) != sum(sizes) or min(sizes, default=0) <= 0:
        raise ValueError(f"columns {widths} (together {sum(widths)}) cannot be cut into {list(sizes)}")
    bounds = list(itertools.pairwise([0, *itertools.accumulate(widths)]))
    runs, begin = [], 0
    for size in sizes:
        end = begin + size
        slices = [
            piece[..., max(begin, start) - start : min(end, stop) - start]
            for piece, (start, stop) in zip(pieces, bounds, strict=True)
            if start < end and begin < stop
        ]
        runs.append(joined(slices))
        begin = end
    return runs


class PackedEmbedding(nn.Module):
    """A token embedding whose table may be kept quantised: a lookup dequantises only the rows it reads."""

    def __init__(self, table: Rows, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = table
        self.dtype = dtype

    def forward(self, tokens: Tensor) -> Tensor:
        return self.table.lookup(tokens, self.dtype)

    def dense(self, dtype: torch.dtype) -> Tensor:
        return self.table.dense(dtype)
