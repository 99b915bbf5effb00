"""Activations times GGUF-quantised weights kept in their blocks: one function, two bodies.

`quant_linear` is what the model calls. On a CUDA device it runs Triton (strata.stage_worker.kernels.
quant_matmul_triton): for up to FUSED_MAX_ROWS rows of x (decode) a fused kernel reads the planes once and never
writes the weight out, its products on the CUDA cores; up to GEMM_MAX_ROWS (a batch of decode streams) a kernel that
dequantises tiles in registers and multiplies them on the tensor cores (quant_gemm_triton); for more rows (prefill)
the weight is dequantised into x's dtype once and cuBLAS multiplies, its cost spread over many rows. Anywhere else,
and as the kernels' test oracle, it runs `reference`: the f32 values of strata.stage_worker.weights.formats, rounded
to x's dtype, then `x @ w.T`.

Both are registered as torch custom ops so that torch.compile keeps them whole inside a compiled block (and a CUDA
graph replays them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from enum import IntEnum

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from strata.stage_worker.weights.formats import FORMATS, dequantize, plane_names
from torch import Tensor

FUSED_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q5_1,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    }
)
# Types whose one-row decode products take the block's residual add and RMS norm in their load of x
# (PackedLinear.takes_norm). On an H200 (2026-11-29, Llama-3-8B's matrices, us a product, plain against normed with
# the add): Q8_0 pays 1-3 us a matrix (qkv 10.4 -> 12.4, gate_up 33.4 -> 36.8), less than the add+norm launch and its
# gap that go; Q4_K 3-9 (gate_up 30.2 -> 38.7) and Q6_K 3-16 (gate_up 36.4 -> 52.0), more than they save. Each program
# reads the whole row of x, the residual and the norm's weight, which is more bytes than its 4-bit weight rows.
NORMED_TYPES: frozenset[GGMLQuantizationType] = frozenset({GGMLQuantizationType.Q8_0})
# Rows of x up to which the fused kernel beats the tensor-core one (an H100, Llama-3-8B's matrices, Q4_K, Q6_K and
# Q8_0; bench/quant_matmul.py --crossover, 2026-11-25): at 4 rows it is ahead on every matrix (Q4_K gate_up 70 against
# 74 us, Q8_0 60 against 71), at 8 behind on every one (Q4_K gate_up 115 against 79, Q8_0 104 against 73).
FUSED_MAX_ROWS = 4
# Rows of x from which a gated feed-forward's down projection forms act(gate) * up in its load of x
# (PackedLinear.forms_gate): only in the tensor-core kernel, whose programs read x a tile at a time. In the fused
# kernel every program reads the whole row of gate and up and forms the activation again, and on an H200 (2026-11-29,
# bench/quant_matmul.py --fusions, one row, us a product: plain / gated / activation apart) that cost more than the
# launch it saves for every type: Q8_0 18.8 / 26.1 / 20.7, Q4_K 18.7 / 30.0 / 20.4, Q6_K 21.8 / 30.1 / 23.7.
GATED_MIN_ROWS = FUSED_MAX_ROWS + 1
# Rows up to which the tensor-core kernel beats dequantise-then-cuBLAS (same H100 and matrices): at 16 rows 1.4-2.9x
# faster (Q8_0 gate_up 76 against 218 us, near cuBLAS on bf16 weights), at 64 still ahead over a layer's four
# matrices (Q4_K 339 against 367 us), though no longer on the small ones.
GEMM_MAX_ROWS = 64
# Rows of bf16 x (on a GPU) whose products with matrices of at least DOT8_MIN_WEIGHTS weights round x to 8 bits a
# block of 32 and take integer dot products (quant_dot8_triton): the fused kernel issues 2.2 instructions a weight and
# a row there, dp4a 0.5-1.1. On an H200 (2026-11-29, bench/quant_matmul.py --dot8, Llama-3-8B's matrices, us a
# product, fused against dp4a, x's quantising launch included) dp4a takes 4 rows of gate_up in 42 against 61 (Q8_0),
# 41 against 72 (Q4_K), 50 against 77 (Q6_K), and of down 25 against 32-40; at 2 rows 1.1-1.6x on gate_up. On qkv and
# o (25 and 17 million weights) its fixed costs (the extra launch, the split sums) leave it 0.74-1.1x. One row has a
# rule and launch shapes of its own (below).
DOT8_ROWS = range(2, FUSED_MAX_ROWS + 1)
DOT8_MIN_WEIGHTS = 1 << 25
DOT8_TYPES = frozenset({GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K})
# One row takes dp4a only where the H200 measured it ahead (2026-11-29, a scratch sweep of launch shapes at one row, us
# a product, fused at its best shape against dp4a at its): Q4_K's gate_up 29.8 against 27.7 and down 18.3 against
# 17.9; Q6_K's output head (525 million weights) 145.3 against 107.7, its gate_up 35.9 against 33.8, but not its down
# (21.7 against 22.0: 59 million weights, under the bound). Q8_0 lost on every matrix (gate_up 33.9 against 37.2).
DOT8_ONE_ROW_MIN_WEIGHTS = {GGMLQuantizationType.Q4_K: 1 << 25, GGMLQuantizationType.Q6_K: 1 << 26}


def rows_variant(rows: int) -> tuple[str, int, bool]:
    """Which compiled kernels a product of `rows` rows of x runs (a new one compiles for seconds): the fused kernel
    by the power of two that holds the rows (and one row alone), the tensor-core one by the rows themselves (its tile,
    its split of K and the strides it is specialised on all follow them: an H200 compiled 21 rows apart from 18), or
    dequantise-then-cuBLAS. A stage's warm-up runs a step of each one its batches meet."""
    if rows <= FUSED_MAX_ROWS:
        return ("fused", 1 << (rows - 1).bit_length(), rows == 1)
    if rows <= GEMM_MAX_ROWS:
        return ("gemm", rows, False)
    return ("dense", 0, False)


def product_path(
    rows: int, weights: int, ggml_type: GGMLQuantizationType, *, dtype: torch.dtype, cuda: bool, gated: bool
) -> str:
    """Which kernel multiplies `rows` rows of x by a matrix of `weights` weights of ggml_type: "dot8"
    (quant_dot8_triton; bf16 x on a GPU only, its x rounded to 8 bits), "fused", "gemm" (the tensor-core kernel), or
    "dense" (dequantised, then x @ w.T)."""
    if rows == 1:
        least = DOT8_ONE_ROW_MIN_WEIGHTS.get(ggml_type)
    else:
        least = DOT8_MIN_WEIGHTS if rows in DOT8_ROWS and ggml_type in DOT8_TYPES else None
    if least is not None and weights >= least and cuda and dtype == torch.bfloat16 and not gated:
        return "dot8"
    if ggml_type not in FUSED_TYPES:
        return "dense"
    return "fused" if rows <= FUSED_MAX_ROWS else "gemm" if rows <= GEMM_MAX_ROWS else "dense"


class Gate(IntEnum):
    """What x is made of (quant_blocks_triton's GATE_ constants): x itself, or act(gate) * up of a gated feed-forward's
    [M, 2K] gate and up, which the kernels form as they load x."""

    NONE = 0
    SILU = 1
    GELU_TANH = 2


def activated(gate_up: Tensor, gate: Gate) -> Tensor:
    """act(gate) * up of gate_up [M, 2K], computed in f32 and rounded once, as the kernels form it."""
    g, u = gate_up.float().chunk(2, dim=-1)
    act = F.silu(g) if gate is Gate.SILU else F.gelu(g, approximate="tanh")
    return (act * u).to(gate_up.dtype)


def _as_list(planes: Mapping[str, Tensor] | Sequence[Tensor], ggml_type: GGMLQuantizationType) -> list[Tensor]:
    if isinstance(planes, Mapping):
        return [planes[name] for name in plane_names(ggml_type)]
    return list(planes)


def _columns(planes: Sequence[Tensor], ggml_type: GGMLQuantizationType) -> int:
    d = planes[plane_names(ggml_type).index("d")]  # every type has one f16 scale a block
    return int(d.shape[1]) * FORMATS[ggml_type].block_elements


def reference(x: Tensor, planes: Sequence[Tensor], ggml_type: GGMLQuantizationType) -> Tensor:
    """x [M, K] @ W.T with W the planes' f32 values rounded to x's dtype: the CPU path and the kernels' oracle."""
    w = dequantize(dict(zip(plane_names(ggml_type), planes, strict=True)), ggml_type)
    return x @ w.to(x.dtype).T


def _device(t: Tensor) -> torch.cuda.device | nullcontext[None]:
    # Triton launches on the current device's stream, whatever the tensors say (under its interpreter, on the CPU).
    return torch.cuda.device(t.device) if t.device.type == "cuda" else nullcontext()


@torch.library.custom_op("strata::dequantize_planes", mutates_args=())
def _dequantize_op(planes: list[Tensor], ggml_type: int, columns: int, dtype: torch.dtype) -> Tensor:
    from strata.stage_worker.kernels import quant_matmul_triton

    with _device(planes[0]):
        return quant_matmul_triton.dequantize(planes, GGMLQuantizationType(ggml_type), columns=columns, dtype=dtype)


@_dequantize_op.register_fake
def _(planes: list[Tensor], ggml_type: int, columns: int, dtype: torch.dtype) -> Tensor:
    return planes[0].new_empty((planes[0].shape[0], columns), dtype=dtype)


@torch.library.custom_op("strata::quant_linear", mutates_args=())
def _quant_linear_op(
    x: Tensor, planes: list[Tensor], ggml_type: int, columns: int, gate: int, activate: int = 0
) -> Tensor:
    from strata.stage_worker.kernels import norms_and_gates, quant_matmul_triton

    t = GGMLQuantizationType(ggml_type)
    with _device(x):
        weights = planes[0].shape[0] * columns
        path = product_path(x.shape[0], weights, t, dtype=x.dtype, cuda=x.is_cuda, gated=bool(gate))
        if path == "dot8":
            from strata.stage_worker.kernels import quant_dot8_triton

            return quant_dot8_triton.dot8(x, planes, t, activate=activate)
        if path == "fused":
            return quant_matmul_triton.quant_matmul(x, planes, t, columns=columns, gate=gate, activate=activate)
        if path == "gemm":
            from strata.stage_worker.kernels import quant_gemm_triton

            out = quant_gemm_triton.quant_gemm(x, planes, t, columns=columns, gate=gate)
        else:
            if gate:
                # one launch on a GPU: in torch, f32 copies of a prefill's whole gate/up output and back
                x = norms_and_gates.activate(x, Gate(gate))
            out = x @ quant_matmul_triton.dequantize(planes, t, columns=columns, dtype=x.dtype).T
        return activated(out, Gate(activate)) if activate else out


@_quant_linear_op.register_fake
def _(x: Tensor, planes: list[Tensor], ggml_type: int, columns: int, gate: int, activate: int = 0) -> Tensor:
    return x.new_empty((x.shape[0], planes[0].shape[0] // (2 if activate else 1)))


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The model's RMSNorm (model.RMSNorm): x * rsqrt(mean(x^2) + eps) in f32, rounded to x's dtype, times the
    weight. Here so that the normed kernels' oracle is the model's own function."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def normed_reference(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(h, rms_norm(h) * weight) with h = x (+ residual), in x's dtype."""
    h = x if residual is None else x + residual
    return h, rms_norm(h, weight, eps).to(h.dtype)


@torch.library.custom_op("strata::quant_linear_normed", mutates_args=())
def _quant_linear_normed_op(
    x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, planes: list[Tensor], ggml_type: int, columns: int,
    activate: int = 0,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    from strata.stage_worker.kernels import quant_matmul_triton

    t = GGMLQuantizationType(ggml_type)
    with _device(x):
        if x.shape[0] <= FUSED_MAX_ROWS and t in FUSED_TYPES:
            norm = quant_matmul_triton.Norm(weight=weight, eps=eps, residual=residual)
            out, h = quant_matmul_triton.quant_matmul_normed(x, planes, t, columns=columns, norm=norm,
                                                             activate=activate)  # fmt: skip
            return out, x.new_empty(0) if h is None else h
        h, normed = normed_reference(x, residual, weight, eps)
        out = _quant_linear_op(normed, planes, ggml_type, columns, int(Gate.NONE))
        if activate:
            out = activated(out, Gate(activate))
        return out, x.new_empty(0) if residual is None else h


@_quant_linear_normed_op.register_fake
def _(
    x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, planes: list[Tensor], ggml_type: int, columns: int,
    activate: int = 0,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    out = x.new_empty((x.shape[0], planes[0].shape[0] // (2 if activate else 1)))
    return out, x.new_empty(0) if residual is None else torch.empty_like(x)


def kernel_normed(
    x: Tensor,
    residual: Tensor | None,
    planes: Sequence[Tensor],
    ggml_type: GGMLQuantizationType,
    *,
    columns: int,
    weight: Tensor,
    eps: float,
    activate: Gate = Gate.NONE,
) -> tuple[Tensor, Tensor]:
    """(rms_norm(h) * weight @ W.T, h) with h = x (+ residual), x [M, K], on the Triton path: for up to
    FUSED_MAX_ROWS rows one launch, the norm (and the residual add) formed in the fused kernel's load of x. With
    `activate`, W is a gated feed-forward's gate rows over its up rows and the product act(gate) * up [M, N / 2],
    formed in the same launch (`activated` of the product elsewhere)."""
    out, h = _quant_linear_normed_op(x, residual, weight, eps, list(planes), int(ggml_type), columns, int(activate))
    return out, x if residual is None else h


def kernel(
    x: Tensor, planes: Sequence[Tensor], ggml_type: GGMLQuantizationType, *, columns: int, gate: Gate = Gate.NONE,
    activate: Gate = Gate.NONE,
) -> Tensor:  # fmt: skip
    """The Triton path on x [M, K] (with a gate, [M, 2K] gate and up), on any device (on the CPU under Triton's
    interpreter: the tests' way in). With `activate`, W is a gated feed-forward's gate rows over its up rows, and the
    product act(gate) * up [M, N / 2]: formed as the fused and dp4a kernels store, `activated` after the others."""
    out: Tensor = _quant_linear_op(x, list(planes), int(ggml_type), columns, int(gate), int(activate))
    return out


def quant_linear(x: Tensor, planes: Sequence[Tensor], ggml_type: GGMLQuantizationType, *, columns: int) -> Tensor:
    """x [..., K] (bf16, f16 or f32) @ W.T -> [..., N] in x's dtype; `planes` in `plane_names(ggml_type)` order,
    `columns` = K. CUDA: `kernel`; elsewhere: `reference`."""
    if x.shape[-1] != columns:
        raise ValueError(f"x has {x.shape[-1]} columns, the weight {columns}")
    rows = x.reshape(-1, columns)
    if x.device.type == "cuda":
        out = kernel(rows, planes, ggml_type, columns=columns)
    else:
        out = reference(rows, planes, ggml_type)
    return out.view(*x.shape[:-1], out.shape[-1])


def dequantize_as(
    planes: Mapping[str, Tensor] | Sequence[Tensor], ggml_type: GGMLQuantizationType, dtype: torch.dtype
) -> Tensor:
    """W [N, K] in `dtype` (the f32 reference's values, rounded once); planes as a dict by name or a list in
    `plane_names(ggml_type)` order. CUDA: a Triton kernel; elsewhere: the reference."""
    ordered = _as_list(planes, ggml_type)
    if ordered[0].device.type != "cuda":
        return dequantize(dict(zip(plane_names(ggml_type), ordered, strict=True)), ggml_type).to(dtype)
    out: Tensor = _dequantize_op(ordered, int(ggml_type), _columns(ordered, ggml_type), dtype)
    return out
