"""The quantised-matmul kernels against the f32 reference, on a table of named cases.

Without a GPU the Triton kernels run under Triton's interpreter (tests/conftest.py), in f32 and f16 (the interpreter
has no bfloat16); on a GPU, compiled, in bf16 too. Each case builds random GGUF bytes of one type (every bit of
every quantised field random; the f16 fields set per case, finite: the planes test covers NaN and inf) and splits
them into planes as the loader does. Up to 16 rows of x the cases run the fused kernel; more rows (and the cases marked
`op`) run `kernel`, the Triton path the model takes on a GPU: the fused kernel up to FUSED_MAX_ROWS, the tensor-core
kernel up to GEMM_MAX_ROWS, the dequantised weight beyond.

The check: every output within `tolerance(dtype)` of `x.float() @ dequantize(planes).T`, as a share of
sum |x| |w| over that output (what an accumulation error scales with), so a wrong value anywhere in a row shows.

`kernel_normed` forms a decode step's norm (and the residual add before it) in the fused kernel's load of x: its
cases check the product against `rms_norm(h) * g @ W.T` (the reference rounds the normed x to x's dtype, the kernel
does not) and h, the new residual stream, against x + residual bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from strata.stage_worker.kernels import (
    product_outputs_triton,
    quant_blocks_triton,
    quant_gemm_triton,
    quant_matmul_triton,
)
from strata.stage_worker.kernels.quant_matmul import (
    FUSED_MAX_ROWS,
    FUSED_TYPES,
    Gate,
    activated,
    dequantize_as,
    kernel,
    kernel_normed,
    normed_reference,
    quant_linear,
    reference,
)
from strata.stage_worker.kernels.quant_matmul_triton import TALL_N
from strata.stage_worker.weights.formats import FORMATS, dequantize, plane_names, split_planes

Q = GGMLQuantizationType
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


@dataclass(frozen=True)
class Case:
    name: str
    ggml_type: GGMLQuantizationType
    m: int  # rows of x: up to 16 the fused kernel, then `kernel`'s paths (17, 40: tensor cores; 65: dequantise)
    n: int  # weight rows, not a multiple of any BLOCK_N
    k: int
    blocks: str  # the f16 fields: "normal", "extreme" (+-65504 beside tiny), "zero" (a third of blocks all zero
    # bytes), "negative" (every f16 field negative: negative minimums)
    op: bool = False  # through `kernel` whatever m: rows past FUSED_MAX_ROWS take the tensor-core kernel
    splits: int | None = None  # the kernel (fused, or tensor-core past 16 rows) split along K this many ways
    # (SPLIT_CHUNKS chunks a step)


def _k(ggml_type: GGMLQuantizationType, *, long: bool) -> int:
    """Columns: a few blocks, ending inside a tile of chunks; `long`: over more than one K step of the kernels."""
    if ggml_type in K_QUANTS:
        return 1280 if long else 768
    return 1088 if long else 96


def _cases() -> list[Case]:
    cases = []
    for t in sorted(FUSED_TYPES):
        short, long = _k(t, long=False), _k(t, long=True)
        cases += [Case(f"{t.name} M={m}", t, m, 37 if m < 16 else 19, short, "normal") for m in (1, 3, 16, 17, 40, 65)]
        cases += [Case(f"{t.name} M={m}, K={long}", t, m, 21, long, "normal") for m in (1, 3, 33)]
        cases += [Case(f"{t.name} M={m}, K={long} split along K", t, m, 21, long, "normal", splits=2) for m in (1, 3)]
        cases += [Case(f"{t.name} M=33, K={long} split along K (tensor cores)", t, 33, 21, long, "normal", splits=2)]
        cases += [Case(f"{t.name} M=6 through the op (tensor cores)", t, 6, 37, short, "normal", op=True)]
        cases += [Case(f"{t.name} M={m}, extreme scales", t, m, 19, short, "extreme") for m in (1, 16, 24)]
        cases += [Case(f"{t.name} M=3, zero blocks", t, 3, 19, short, "zero")]
        cases += [Case(f"{t.name} M={m}, negative scales", t, m, 19, short, "negative") for m in (1, 17, 65)]
    # Q4_K's tall matrices (a gate/up projection) take a tile of their own in the tensor-core kernel.
    return [*cases, Case("Q4_K M=16 through the op, a tall matrix", Q.Q4_K, 16, TALL_N + 37, 256, "normal", op=True)]


CASES = _cases()
SPLIT_CHUNKS = 2  # few chunks a step, so that the long K is steps enough to split


@pytest.mark.parametrize("case", [c for c in CASES if c.splits], ids=lambda c: c.name)
def test_split_cases_split(case: Case) -> None:
    """The cases that ask for splits get them, so their parts are summed in the kernel (product_outputs_triton.
    sum_splits)."""
    n_chunks = quant_blocks_triton.chunk_count(case.k, case.ggml_type)
    if case.m > quant_matmul_triton.MAX_ROWS:
        block_n = quant_gemm_triton.default_tile(case.ggml_type, case.m, case.n)[0]
    else:
        block_n = quant_matmul_triton.default_config(case.ggml_type, case.m, n=case.n, k=case.k).block_n or 4
    _, out = product_outputs_triton.split_output(
        torch.zeros(case.m, case.k), n=case.n, n_chunks=n_chunks, chunks=SPLIT_CHUNKS,
        programs=-(-case.n // block_n), splits=case.splits,
    )  # fmt: skip
    assert out.splits == case.splits


def dtypes() -> list[torch.dtype]:
    return [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])


def tolerance(dtype: torch.dtype) -> float:
    """f32: accumulation; f16/bf16: the output's rounding, and beyond 16 rows the weight's rounding to x's dtype."""
    return {torch.float32: 1e-5, torch.float16: 2e-3}.get(dtype, 1.2e-2)


def random_planes(case: Case, rng: np.random.Generator) -> dict[str, torch.Tensor]:
    elements, size = GGML_QUANT_SIZES[case.ggml_type]
    blocks = rng.integers(0, 256, size=(case.n, case.k // elements, size), dtype=np.uint8)
    for field in FORMATS[case.ggml_type].fields:
        if field.dtype != torch.float16:
            continue
        shape = blocks.shape[:2]
        if case.blocks == "extreme":
            choices = np.array([65504.0, -65504.0, 6.1e-5, -6.0e-8, 1.0e-3], dtype=np.float16)
            value = rng.choice(choices, size=shape)
        else:
            value = (rng.standard_normal(shape) * 1e-2).astype(np.float16)
            if case.blocks == "negative":
                value = -np.abs(value)
        blocks[:, :, field.offset : field.offset + 2] = value.view(np.uint8).reshape(*shape, 2)
    if case.blocks == "zero":
        blocks[rng.random(blocks.shape[:2]) < 1 / 3] = 0
    return split_planes(torch.from_numpy(blocks).reshape(-1), case.ggml_type, rows=case.n)


def relative_error(ours: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    """max |ours - x w^T| / (|x| |w|^T + the smallest normal of ours' dtype: below it, the dtype's steps are fixed)."""
    expected = x.float() @ w.T
    bound = x.float().abs() @ w.abs().T + torch.finfo(ours.dtype).tiny
    return float(((ours.float() - expected).abs() / bound).max())


def run_case(case: Case, *, device: torch.device, dtype: torch.dtype, seed: int = 0) -> float:
    """The Triton path against the reference on fresh random inputs; the largest relative error (NaN fails)."""
    rng = np.random.default_rng(seed)
    planes = random_planes(case, rng)
    w = dequantize(planes, case.ggml_type)
    # Outputs inside f16's range, whatever the weights' magnitude.
    scale = min(1.0, 100.0 / float(w.abs().sum(dim=1).max().clamp_min(1e-30)))
    x = (torch.from_numpy(rng.standard_normal((case.m, case.k))).float() * scale).to(dtype)
    on_device = [p.to(device) for p in planes.values()]
    if case.splits and case.m > quant_matmul_triton.MAX_ROWS:
        ours = quant_gemm_triton.quant_gemm(
            x.to(device), on_device, case.ggml_type, columns=case.k, chunks=SPLIT_CHUNKS, splits=case.splits
        )
    elif case.m <= quant_matmul_triton.MAX_ROWS and not case.op:
        config = None if case.splits is None else quant_matmul_triton.Config(chunks=SPLIT_CHUNKS, splits=case.splits)
        ours = quant_matmul_triton.quant_matmul(x.to(device), on_device, case.ggml_type, columns=case.k, config=config)
    else:
        ours = kernel(x.to(device), on_device, case.ggml_type, columns=case.k)
    assert ours.shape == (case.m, case.n)
    assert ours.dtype == dtype
    return relative_error(ours.cpu(), x, w)


def _applies(case: Case, dtype: torch.dtype) -> bool:
    # Beyond the fused kernel the weights are rounded to x's dtype (in tiles, or whole for cuBLAS): extreme f16 scales
    # make values past f16's largest, as any f16 matmul of them would.
    return not (case.blocks == "extreme" and dtype == torch.float16 and case.m > FUSED_MAX_ROWS)


@pytest.mark.parametrize(
    ("case", "dtype"),
    [
        pytest.param(case, dtype, id=f"{case.name}-{str(dtype).removeprefix('torch.')}")
        for case in CASES
        for dtype in dtypes()
        if _applies(case, dtype)
    ],
)
def test_kernel_matches_reference(case: Case, dtype: torch.dtype, device: torch.device) -> None:
    error = run_case(case, device=device, dtype=dtype, seed=len(case.name) * 7 + case.m)
    assert error <= tolerance(dtype), f"{case.name}: relative error {error:.2e} over {tolerance(dtype):.0e}"


@pytest.mark.parametrize("ggml_type", sorted(FUSED_TYPES), ids=lambda t: t.name)
def test_dequantise_kernel_is_the_reference(ggml_type: GGMLQuantizationType, device: torch.device) -> None:
    """In f32 the dequantise kernel computes each value with the reference's one rounding: equal bit for bit."""
    case = Case("", ggml_type, 1, 21, _k(ggml_type, long=True), "extreme")
    planes = random_planes(case, np.random.default_rng(int(ggml_type)))
    on_device = [p.to(device) for p in planes.values()]
    ours = quant_matmul_triton.dequantize(on_device, ggml_type, columns=case.k, dtype=torch.float32)
    assert torch.equal(ours.cpu(), dequantize(planes, ggml_type))


@pytest.mark.parametrize("wrong", ["high nibbles misplaced", "scales swapped"])
def test_a_wrong_kernel_fails_the_check(wrong: str, device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: a kernel that misreads a Q4_K block is caught."""
    if wrong == "high nibbles misplaced":  # right values, multiplied by x 16 columns early
        layouts = dict(quant_blocks_triton.LAYOUTS)
        layouts[Q.Q4_K] = replace(layouts[Q.Q4_K], half_stride=16)
        monkeypatch.setattr(quant_blocks_triton, "LAYOUTS", layouts)
    else:  # sub-block scales and minimums swapped
        planes = dict(quant_blocks_triton.SCALE_PLANES)
        planes[Q.Q4_K] = ("d", "dmin", "m", "sc")
        monkeypatch.setattr(quant_blocks_triton, "SCALE_PLANES", planes)
    case = Case("", Q.Q4_K, 1, 19, 768, "normal")
    assert run_case(case, device=device, dtype=torch.float32) > 1e-2


def test_public_functions(device: torch.device) -> None:
    """quant_linear takes any leading dimensions and is the reference on the CPU; `kernel` (the op) takes the fused
    kernel for a few rows; dequantize_as takes the planes as a dict or a list."""
    case = Case("", Q.Q4_K, 1, 19, 512, "normal")
    planes = random_planes(case, np.random.default_rng(3))
    ordered = [planes[name] for name in plane_names(Q.Q4_K)]
    x = torch.randn(2, 3, 512)
    y = quant_linear(x, ordered, Q.Q4_K, columns=512)
    assert y.shape == (2, 3, 19)
    assert torch.equal(y.reshape(6, 19), reference(x.reshape(6, 512), ordered, Q.Q4_K))
    few = x[0, :FUSED_MAX_ROWS]
    fused = kernel(few.to(device), [p.to(device) for p in ordered], Q.Q4_K, columns=512).cpu()
    assert relative_error(fused, few, dequantize(planes, Q.Q4_K)) <= tolerance(torch.float32)
    on_device = {name: p.to(device) for name, p in planes.items()}
    for given in (on_device, list(on_device.values())):
        assert torch.equal(dequantize_as(given, Q.Q4_K, torch.float32).cpu(), dequantize(planes, Q.Q4_K))


@pytest.mark.parametrize("m", [1, 17])
def test_custom_ops_pass_opcheck(m: int, device: torch.device) -> None:
    """The ops' schemas and fake implementations hold (what torch.compile relies on)."""
    from strata.stage_worker.kernels import quant_matmul

    case = Case("", Q.Q8_0, m, 5, 64, "normal")
    planes = [p.to(device) for p in random_planes(case, np.random.default_rng(4)).values()]
    x = torch.randn(m, 64, device=device)
    torch.library.opcheck(quant_matmul._quant_linear_op, (x, planes, int(Q.Q8_0), 64, int(Gate.NONE)))
    gate_up = torch.randn(m, 128, device=device)
    torch.library.opcheck(quant_matmul._quant_linear_op, (gate_up, planes, int(Q.Q8_0), 64, int(Gate.SILU)))
    torch.library.opcheck(quant_matmul._dequantize_op, (planes, int(Q.Q8_0), 64, torch.float16))


@dataclass(frozen=True)
class GatedCase:
    name: str
    ggml_type: GGMLQuantizationType
    m: int  # 1-4: the fused kernel; 6, 40: tensor cores; 65: torch forms the activation, then the dequantised weight
    gate: Gate
    spread: float = 1.0  # the gate's standard deviation: 30 puts exp(-gate) past f32's range at both ends


GATED_CASES = [
    GatedCase(f"{t.name} M={m} {gate.name}", t, m, gate)
    for t in (Q.Q8_0, Q.Q4_K, Q.Q6_K)
    for m in (1, 3, 6, 65)
    for gate in (Gate.SILU, Gate.GELU_TANH)
] + [GatedCase(f"{t.name} M={m} SILU, gates far past exp's range", t, m, Gate.SILU, 30.0) for t in (Q.Q8_0, Q.Q4_K)
     for m in (1, 6)]  # fmt: skip


@pytest.mark.parametrize("case", GATED_CASES, ids=lambda c: c.name)
def test_gated_product_matches_the_activation_then_the_product(case: GatedCase, device: torch.device) -> None:
    """A gated feed-forward's down projection, act(gate) * up @ W.T, formed in the kernels' load of x (the op the
    model takes on a GPU), against `activated` (f32, rounded once, as the kernels form it) and the f32 product."""
    plain = Case("", case.ggml_type, case.m, 21, _k(case.ggml_type, long=True), "normal")
    rng = np.random.default_rng(case.m + int(case.gate))
    planes = random_planes(plain, rng)
    w = dequantize(planes, case.ggml_type)
    scale = min(1.0, 100.0 / float(w.abs().sum(dim=1).max().clamp_min(1e-30)))
    gate = torch.from_numpy(rng.standard_normal((case.m, plain.k))).float() * case.spread
    up = torch.from_numpy(rng.standard_normal((case.m, plain.k))).float() * scale
    gate_up = torch.cat((gate, up), dim=1)
    ours = kernel(gate_up.to(device), [p.to(device) for p in planes.values()], case.ggml_type, columns=plain.k,
                  gate=case.gate)  # fmt: skip
    assert ours.shape == (case.m, plain.n)
    error = relative_error(ours.cpu(), activated(gate_up, case.gate), w)
    assert error <= tolerance(torch.float32), f"{case.name}: relative error {error:.2e}"


def test_a_gate_that_is_not_formed_fails_the_check(device: torch.device) -> None:
    """The check can fail: the product of x as given (no activation) is far from the gated one."""
    plain = Case("", Q.Q8_0, 1, 21, 96, "normal")
    planes = random_planes(plain, np.random.default_rng(5))
    w = dequantize(planes, Q.Q8_0)
    gate_up = torch.randn(1, 192)
    ungated = kernel(gate_up[:, :96].to(device), [p.to(device) for p in planes.values()], Q.Q8_0, columns=96)
    assert relative_error(ungated.cpu(), activated(gate_up, Gate.SILU), w) > 1e-2


@dataclass(frozen=True)
class NormedCase:
    name: str
    ggml_type: GGMLQuantizationType
    m: int  # 1-4: the fused kernel; 6, 65: torch forms the norm, then the tensor-core or dequantised product
    residual: bool = True
    x: str = "normal"  # "normal"; "large" (|x| to 1e4: squares past f16's range, summed in f32); "zero row"
    weight: str = "normal"  # the norm's weight: "normal" around 1, "signed" (negative values too)


NORMED_CASES = [
    NormedCase(f"{t.name} M={m}", t, m) for t in (Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.Q4_0, Q.Q5_K) for m in (1, 3, 4)
] + [
    NormedCase("Q8_0 M=1, no residual (a stage's first block)", Q.Q8_0, 1, residual=False),
    NormedCase("Q4_K M=3, no residual", Q.Q4_K, 3, residual=False),
    NormedCase("Q8_0 M=2, large x", Q.Q8_0, 2, x="large"),
    NormedCase("Q4_K M=1, large x", Q.Q4_K, 1, x="large"),
    NormedCase("Q6_K M=3, a zero row", Q.Q6_K, 3, x="zero row"),
    NormedCase("Q4_K M=4, signed weight", Q.Q4_K, 4, weight="signed"),
    NormedCase("Q8_0 M=6 through torch, then tensor cores", Q.Q8_0, 6),
    NormedCase("Q4_K M=65 through torch, then the dequantised weight", Q.Q4_K, 65),
]

EPS = 1e-6


def _inputs(case: NormedCase, k: int, dtype: torch.dtype, rng: np.random.Generator) -> tuple[torch.Tensor, ...]:
    def normal(*shape: int) -> torch.Tensor:
        return torch.from_numpy(rng.standard_normal(shape)).float()

    spread = 1e4 if case.x == "large" else 1.0
    x = (normal(case.m, k) * spread).to(dtype)
    residual = (normal(case.m, k) * spread).to(dtype)
    if case.x == "zero row":
        x[1], residual[1] = 0.0, 0.0
    weight = 1.0 + 0.1 * normal(k) if case.weight == "normal" else normal(k)
    return x, residual, weight.to(dtype)


@pytest.mark.parametrize(
    ("case", "dtype"),
    [pytest.param(c, d, id=f"{c.name}-{str(d).removeprefix('torch.')}") for c in NORMED_CASES for d in dtypes()],
)
def test_normed_product_matches_the_norm_then_the_product(
    case: NormedCase, dtype: torch.dtype, device: torch.device
) -> None:
    plain = Case("", case.ggml_type, case.m, 21, _k(case.ggml_type, long=True), "normal")
    rng = np.random.default_rng(case.m * 31 + int(case.ggml_type))
    planes = random_planes(plain, rng)
    w = dequantize(planes, case.ggml_type)
    x, residual, weight = _inputs(case, plain.k, dtype, rng)
    given = residual if case.residual else None
    out, h = kernel_normed(
        x.to(device), None if given is None else given.to(device), [p.to(device) for p in planes.values()],
        case.ggml_type, columns=plain.k, weight=weight.to(device), eps=EPS,
    )  # fmt: skip
    expected_h, normed = normed_reference(x, given, weight, EPS)
    assert torch.equal(h.cpu(), expected_h), f"{case.name}: h is not x + residual"
    assert out.shape == (case.m, plain.n)
    assert out.dtype == dtype
    error = relative_error(out.cpu(), normed, w)
    assert error <= tolerance(dtype), f"{case.name}: relative error {error:.2e} over {tolerance(dtype):.0e}"


def test_a_norm_left_out_fails_the_check(device: torch.device) -> None:
    """The check can fail: the product of h itself (no norm) is far from the normed one."""
    plain = Case("", Q.Q8_0, 1, 21, 96, "normal")
    planes = random_planes(plain, np.random.default_rng(6))
    w = dequantize(planes, Q.Q8_0)
    x, residual = torch.randn(1, 96) * 5, torch.randn(1, 96) * 5
    _, normed = normed_reference(x, residual, torch.ones(96), EPS)
    plain_product = kernel((x + residual).to(device), [p.to(device) for p in planes.values()], Q.Q8_0, columns=96)
    assert relative_error(plain_product.cpu(), normed, w) > 1e-2


@pytest.mark.parametrize("m", [1, 6])
def test_the_normed_op_passes_opcheck(m: int, device: torch.device) -> None:
    """Its schema and fake implementation hold (what torch.compile relies on), with and without a residual."""
    from strata.stage_worker.kernels import quant_matmul

    plain = Case("", Q.Q8_0, m, 5, 64, "normal")
    planes = [p.to(device) for p in random_planes(plain, np.random.default_rng(7)).values()]
    x, residual, weight = (torch.randn(m, 64, device=device), torch.randn(m, 64, device=device),
                           torch.randn(64, device=device))  # fmt: skip
    for given in (residual, None):
        torch.library.opcheck(quant_matmul._quant_linear_normed_op, (x, given, weight, EPS, planes, int(Q.Q8_0), 64))
