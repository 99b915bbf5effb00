"""The quantised-matmul kernels on a GPU: time against cuBLAS bf16 on the same values, and check them against the f32
reference. One run, one table.

    python bench/quant_matmul.py [--types Q8_0,Q4_K,Q6_K] [--sweep | --crossover | --fusions | --dot8 | --normed]
        [--out FILE.json]

For each fused type, Llama-3-8B's matrices (N x K: 6144 x 4096 qkv, 4096 x 4096 o, 28672 x 4096 gate_up,
4096 x 14336 down) and M = 1, 4, 16, 32 rows of bf16 x: `quant_linear` (the custom op the model calls: the fused
kernel up to FUSED_MAX_ROWS rows, the tensor-core kernel up to GEMM_MAX_ROWS, dequantise-then-cuBLAS beyond) against
`x @ w.T` with w the same values already in bf16.
Weights are random blocks with finite f16 scales.

Timing: CUDA graphs of many calls (what decode replays), each call on another copy of the weight so that the copies
together overflow L2 and every call reads its bytes from HBM; the median of the replays, per call. GB/s counts the
quantised bytes the kernel must read (its planes), and the table gives them as a share of a measured read (a sum).

Fidelity: the worst error of any output, bf16 against the f32 reference, as a share of sum |w x| over that output
(the bound an accumulation error scales with), at M = 1, 4, 16, 32, 65.

--dot8 times the dp4a candidate (quant_dot8_triton: x quantised to 8 bits, its own launch included) against the fused
kernel at 1, 2 and 4 rows, with each one's worst error against the exact product.

--normed times the launch shapes of the normed one-row Q8_0 products (qkv and gate/up with the residual add and
RMS norm in their load of x), which --sweep does not.

--sweep times the launch shapes of quant_matmul_triton.Config for the three types of Q8_0 and Q4_K_M files, and
for a batch of streams the tensor-core kernel's tiles against dequantise-then-cuBLAS.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch
import triton
from gguf import GGMLQuantizationType
from strata.stage_worker.kernels import quant_dot8_triton, quant_gemm_triton, quant_matmul, quant_matmul_triton
from strata.stage_worker.kernels.quant_matmul import FUSED_MAX_ROWS, FUSED_TYPES, GEMM_MAX_ROWS, quant_linear
from strata.stage_worker.weights.formats import FORMATS, dequantize, plane_names, planes_bytes, split_planes

Q = GGMLQuantizationType
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (1, 4, 16, 32)
MAIN_TYPES = (Q.Q8_0, Q.Q4_K, Q.Q6_K)
SWEEP_ROWS = {"qkv": (1,), "o": (1, 4), "gate_up": (1, 4), "down": (1,)}  # every matrix at M = 1
L2_OVERFLOW = 256 << 20  # bytes of weight copies per graph: several times any current L2
C = quant_matmul_triton.Config
SWEEP = {  # (block_n, chunks, num_warps[, splits]) per M; splits chosen from the shape where not given
    1: [
        C(4, 128, 4),
        C(8, 64, 2),
        C(4, 64, 2),
        C(8, 32, 1),
        C(4, 256, 4),
        C(8, 128, 4),
        C(2, 256, 4),
        C(4, 256, 8),
        C(2, 128, 2),
        C(4, 256, 4, 2),
        C(8, 64, 2, 2),
        C(4, 128, 4, 2),
        C(4, 256, 4, 4),
    ],
    4: [C(4, 128, 4), C(8, 128, 4), C(16, 128, 4)],
}


def log(message: str) -> None:
    print(message, flush=True)


def random_planes(ggml_type: GGMLQuantizationType, n: int, k: int, *, device: torch.device) -> list[torch.Tensor]:
    """Random blocks, their f16 fields replaced by finite values of a trained weight's size."""
    fmt = FORMATS[ggml_type]
    raw = torch.randint(0, 256, (n * k // fmt.block_elements * fmt.block_bytes,), dtype=torch.uint8, device=device)
    planes = split_planes(raw, ggml_type, rows=n)
    for plane in planes.values():
        if plane.dtype == torch.float16:
            plane.copy_(torch.randn(plane.shape, device=device) * 2e-3)
    return [planes[name] for name in plane_names(ggml_type)]


def graph_time(calls: Sequence[Callable[[], object]], *, replays: int = 15) -> float:
    """Seconds per call: the calls captured in one CUDA graph (repeated to at least 40), median of the replays."""
    for call in calls:
        call()
    repeat = math.ceil(40 / len(calls))
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            for call in calls:
                call()
    times: list[float] = []
    for i in range(replays + 3):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3 / (repeat * len(calls)))
    return float(statistics.median(times))


def read_bandwidth(device: torch.device) -> float:
    """Bytes per second of reading 1 GiB (a sum: what a memory-bound kernel that only reads can hope for)."""
    src = torch.ones(1 << 28, dtype=torch.float32, device=device)
    seconds = graph_time([lambda: src.sum()], replays=5)
    return 4 * src.numel() / seconds


def worst_error(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    """max |y - x w^T| / (|x| |w|^T), in f32."""
    expected = x.float() @ w.T
    bound = x.float().abs() @ w.abs().T
    return float(((y.float() - expected).abs() / bound.clamp_min(1e-30)).max())


def fidelity(ggml_type: GGMLQuantizationType, device: torch.device) -> dict[str, float]:
    """Worst error per M over the shapes."""
    worst: dict[str, float] = {}
    for n, k in SHAPES.values():
        planes = random_planes(ggml_type, n, k, device=device)
        w = dequantize(dict(zip(plane_names(ggml_type), planes, strict=True)), ggml_type)
        for m in (*ROWS, 65):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            error = worst_error(quant_linear(x, planes, ggml_type, columns=k), x, w)
            worst[f"M={m}"] = max(worst.get(f"M={m}", 0.0), error)
    return worst


def timings(
    ggml_type: GGMLQuantizationType,
    n: int,
    k: int,
    m: int,
    device: torch.device,
    configs: Sequence[quant_matmul_triton.Config | Callable[..., torch.Tensor] | None],
) -> tuple[float, list[float], int]:
    """(cuBLAS bf16 seconds, seconds per config (None: the public op; a function: called as f(x, planes)),
    quantised bytes)."""
    planes = random_planes(ggml_type, n, k, device=device)
    size = planes_bytes(dict(zip(plane_names(ggml_type), planes, strict=True)))
    copies = [planes] + [[p.clone() for p in planes] for _ in range(max(1, math.ceil(L2_OVERFLOW / size)) - 1)]
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    ours = []
    for config in configs:
        if config is None:
            calls = [partial(quant_linear, x, p, ggml_type, columns=k) for p in copies]
        elif callable(config):
            calls = [partial(config, x, p) for p in copies]
        else:
            calls = [
                partial(quant_matmul_triton.quant_matmul, x, p, ggml_type, columns=k, config=config) for p in copies
            ]
        ours.append(graph_time(calls))
    del copies
    dense = quant_matmul_triton.dequantize(planes, ggml_type, columns=k, dtype=torch.bfloat16)
    dense_copies = [dense] + [dense.clone() for _ in range(max(1, math.ceil(L2_OVERFLOW / dense.nbytes)) - 1)]
    cublas = graph_time([partial(torch.matmul, x, w.T) for w in dense_copies])
    return cublas, ours, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", default=",".join(t.name for t in sorted(FUSED_TYPES)))
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--no-batch", action="store_true", help="with --sweep: the fused kernel's shapes only")
    parser.add_argument("--crossover", action="store_true", help="only the fused and tensor-core kernels at 1-16 rows")
    parser.add_argument("--fusions", action="store_true", help="only what each fused load of x costs, one row")
    parser.add_argument(
        "--dot8", action="store_true", help="only the dp4a candidate against the fused kernel, 1-4 rows"
    )
    parser.add_argument("--normed", action="store_true", help="only the normed Q8_0 products' launch shapes, one row")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    device = torch.device("cuda:0")
    types = [Q[name] for name in args.types.split(",")]
    props = torch.cuda.get_device_properties(device)
    bandwidth = read_bandwidth(device)
    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    log(f"# {props.name}, {props.multi_processor_count} SMs, L2 {props.L2_cache_size >> 20} MiB; {versions}; "
        f"{time.strftime('%Y-%m-%d')}")  # fmt: skip
    log(f"# device read: {bandwidth / 1e9:.0f} GB/s (a 1 GiB sum)")
    results: dict[str, object] = {"device": props.name, "read_gbps": bandwidth / 1e9}
    if args.crossover:
        results["crossover"] = crossover(device)
        _save(args.out, results)
        return
    if args.normed:
        results["normed"] = normed_shapes(device)
        _save(args.out, results)
        return
    if args.fusions:
        results["fusions"] = fusions(device)
        _save(args.out, results)
        return
    if args.dot8:
        results["dot8"] = dot8(device)
        _save(args.out, results)
        return

    started = time.perf_counter()
    log("\n## Fidelity, bf16 vs f32 reference: worst |error| / sum |w x| of any output, over the four matrices")
    worst = {}
    for ggml_type in types:
        try:
            worst[ggml_type.name] = fidelity(ggml_type, device)
        except Exception as error:  # a kernel that fails to build or run is reported, and the others measured
            log(f"{ggml_type.name}: FAILED {error!r}"[:2000])
            continue
        log(f"{ggml_type.name:6s} " + "  ".join(f"{m} {e:.1e}" for m, e in worst[ggml_type.name].items()))
    results["worst_error"] = worst
    log(f"[{time.perf_counter() - started:.0f} s]")
    _save(args.out, results)

    log("\n## Fused kernel vs cuBLAS bf16 (x @ w.T on the same values), per call in CUDA graphs, weights from HBM")
    log(f"{'type':6s} {'matrix':8s} {'N x K':>12s} {'M':>3s} {'path':>6s} {'ours us':>8s} {'GB/s':>6s} {'%read':>6s} "
        f"{'cuBLAS us':>9s} {'speedup':>7s}")  # fmt: skip
    table = []
    for ggml_type in [t for t in types if t.name in worst]:
        for shape, (n, k) in SHAPES.items():
            for m in ROWS:
                cublas, (ours,), size = timings(ggml_type, n, k, m, device, [None])
                gbps = size / ours / 1e9
                row = {"type": ggml_type.name, "matrix": shape, "n": n, "k": k, "m": m, "us": ours * 1e6,
                       "gbps": gbps, "cublas_us": cublas * 1e6, "speedup": cublas / ours}  # fmt: skip
                table.append(row)
                path = "fused" if m <= FUSED_MAX_ROWS else "gemm" if m <= GEMM_MAX_ROWS else "deq"
                log(f"{ggml_type.name:6s} {shape:8s} {f'{n}x{k}':>12s} {m:3d} {path:>6s} {ours * 1e6:8.1f} {gbps:6.0f} "
                    f"{100 * gbps * 1e9 / bandwidth:5.0f}% {cublas * 1e6:9.1f} {cublas / ours:6.2f}x")  # fmt: skip
    results["table"] = table
    log(f"[{time.perf_counter() - started:.0f} s]")
    _save(args.out, results)

    if args.sweep:
        log("\n## Launch shapes of the fused kernel (us per call; block_n/chunks/warps)")
        sweep = []
        for ggml_type in [t for t in MAIN_TYPES if t.name in worst]:
            for shape, (n, k) in SHAPES.items():
                for m in SWEEP_ROWS[shape]:
                    configs = SWEEP[m]
                    _, times, size = timings(ggml_type, n, k, m, device, list(configs))
                    cells = " ".join(
                        f"{c.block_n}/{c.chunks}/{c.num_warps}{f'/s{c.splits}' if c.splits else ''}={t * 1e6:.1f}"
                        for c, t in zip(configs, times, strict=True)
                    )
                    log(f"{ggml_type.name:5s} {shape:8s} M={m:2d}: {cells}")
                    sweep.append({"type": ggml_type.name, "matrix": shape, "m": m, "us": [t * 1e6 for t in times]})
        results["sweep"] = sweep
        log(f"[{time.perf_counter() - started:.0f} s]")
        _save(args.out, results)

        if args.no_batch:
            return
        log("\n## A batch of streams: tensor-core tiles (block_n/chunks/warps) against dequantise-then-cuBLAS, us")
        batch = []
        for ggml_type in [t for t in MAIN_TYPES if t.name in worst]:
            for shape, (n, k) in SHAPES.items():
                for m in (16, 32, 64):
                    calls = [_dequantised(ggml_type, k), *(_gemm(ggml_type, k, tile) for tile in GEMM_TILES)]
                    cublas, times, _ = timings(ggml_type, n, k, m, device, calls)
                    cells = " ".join(
                        f"{'/'.join(map(str, c))}={t * 1e6:.1f}" for c, t in zip(GEMM_TILES, times[1:], strict=True)
                    )
                    log(f"{ggml_type.name:5s} {shape:8s} M={m:2d}: deq={times[0] * 1e6:.1f} {cells} "
                        f"cuBLAS={cublas * 1e6:.1f}")  # fmt: skip
                    batch.append({"type": ggml_type.name, "matrix": shape, "m": m, "deq_us": times[0] * 1e6,
                                  "gemm_us": [t * 1e6 for t in times[1:]], "cublas_us": cublas * 1e6})  # fmt: skip
        results["batch"] = batch
        log(f"[{time.perf_counter() - started:.0f} s]")
        _save(args.out, results)


def crossover(device: torch.device) -> list[dict[str, object]]:
    """Where the tensor-core kernel starts to beat the fused one: both at 1-16 rows, us per call (FUSED_MAX_ROWS
    is set from this)."""
    log("\n## Fused (CUDA cores) against tensor-core kernel by rows of x, us per call, weights from HBM")
    rows = []
    for ggml_type in MAIN_TYPES:
        for shape, (n, k) in SHAPES.items():
            for m in (1, 2, 4, 8, 16):
                fused = partial(_kernel_call, quant_matmul_triton.quant_matmul, ggml_type, k)
                gemm = partial(_kernel_call, quant_gemm_triton.quant_gemm, ggml_type, k)
                calls: list[Matmul] = [gemm] if m > quant_matmul_triton.MAX_ROWS else [fused, gemm]
                _, times, size = timings(ggml_type, n, k, m, device, calls)
                fused_us = times[0] * 1e6 if len(times) == 2 else float("nan")
                gemm_us = times[-1] * 1e6
                log(f"{ggml_type.name:5s} {shape:8s} M={m:2d}: fused {fused_us:7.1f}  tensor-core {gemm_us:7.1f}  "
                    f"({size / 1e6:.0f} MB)")  # fmt: skip
                rows.append({"type": ggml_type.name, "matrix": shape, "m": m, "fused_us": fused_us,
                             "gemm_us": gemm_us})  # fmt: skip
    return rows


# block_n, chunks, num_warps; the last two are one row's (quant_dot8_triton.launch_shape)
DOT8_SHAPES = ((8, 128, 4), (4, 128, 4), (16, 64, 4), (8, 64, 2), (4, 64, 2), (16, 32, 2), (32, 32, 4))
HEAD = (128256, 4096)  # Llama-3-8B's output head, a matrix of its own at one row


def dot8(device: torch.device) -> list[dict[str, object]]:
    """The dp4a candidate against the fused kernel, 1, 2 and 4 rows of Llama-3-8B's matrices and its output head: us
    per call in CUDA graphs (x's quantising launch included), weights from HBM, and the worst error of each against
    the exact product (bf16 x)."""
    log("\n## dp4a on x quantised to 8 bits against the fused kernel, us per call (block_n/chunks/warps), and errors")
    rows = []
    for ggml_type in MAIN_TYPES:
        for shape, (n, k) in {**SHAPES, "head": HEAD}.items():
            planes = random_planes(ggml_type, n, k, device=device)
            w = dequantize(dict(zip(plane_names(ggml_type), planes, strict=True)), ggml_type)
            for m in (1, 2, 4):
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                fused_error = worst_error(quant_matmul_triton.quant_matmul(x, planes, ggml_type, columns=k), x, w)
                dot8_error = worst_error(quant_dot8_triton.dot8(x, planes, ggml_type), x, w)
                fused = partial(_kernel_call, quant_matmul_triton.quant_matmul, ggml_type, k)
                calls: list[Matmul] = [fused, *(_dot8(ggml_type, shape) for shape in DOT8_SHAPES)]
                _, times, size = timings(ggml_type, n, k, m, device, calls)
                shaped = zip(DOT8_SHAPES, times[1:], strict=True)
                cells = " ".join(f"{'/'.join(map(str, c))}={t * 1e6:.1f}" for c, t in shaped)
                best = min(times[1:])
                log(f"{ggml_type.name:5s} {shape:8s} M={m}: fused {times[0] * 1e6:6.1f}  dp4a {cells}  "
                    f"best {times[0] / best:.2f}x; errors {fused_error:.1e} / {dot8_error:.1e}")  # fmt: skip
                rows.append({"type": ggml_type.name, "matrix": shape, "m": m, "fused_us": times[0] * 1e6,
                             "dot8_us": [t * 1e6 for t in times[1:]], "fused_error": fused_error,
                             "dot8_error": dot8_error, "bytes": size})  # fmt: skip
    return rows


def _dot8(ggml_type: GGMLQuantizationType, shape: tuple[int, int, int]) -> Matmul:
    block_n, chunks, warps = shape

    def call(x: torch.Tensor, planes: list[torch.Tensor]) -> torch.Tensor:
        return quant_dot8_triton.dot8(x, planes, ggml_type, block_n=block_n, chunks=chunks, num_warps=warps)

    return call


def fusions(device: torch.device) -> list[dict[str, object]]:
    """One row of x, what each fused load costs against the launches it replaces (quant_matmul.NORMED_TYPES is set
    from this): the residual add and RMS norm in a qkv or gate/up product's load (`quant_matmul_normed`) against a
    compiled add+norm and the plain product; act(gate) * up in the down projection's load (`gate`) against a compiled
    activation and the plain product. us per call in CUDA graphs, weights from HBM."""
    log("\n## Fused loads of x against separate kernels, one row, us per call (plain product / fused / separate)")
    add_norm = torch.compile(partial(_add_norm, eps=FUSION_EPS))
    activate = torch.compile(_activate)
    rows = []
    for ggml_type in MAIN_TYPES:
        for shape, (n, k) in SHAPES.items():
            if shape == "down":
                gate_up = torch.randn(1, 2 * k, device=device, dtype=torch.bfloat16)
                fused = partial(_gated, gate_up, ggml_type, k)
                separate = partial(_activated, activate, gate_up, ggml_type, k)
            else:
                residual = torch.randn(1, k, device=device, dtype=torch.bfloat16)
                weight = torch.randn(k, device=device, dtype=torch.bfloat16)
                norm = quant_matmul_triton.Norm(weight=weight, eps=FUSION_EPS, residual=residual)
                fused = partial(_normed, norm, ggml_type, k)
                separate = partial(_normed_apart, add_norm, norm, ggml_type, k)
            plain = partial(_kernel_call, quant_matmul_triton.quant_matmul, ggml_type, k)
            _, (plain_s, fused_s, separate_s), _ = timings(ggml_type, n, k, 1, device, [plain, fused, separate])
            what = "gated" if shape == "down" else "add+norm"
            log(f"{ggml_type.name:5s} {shape:8s} {what:8s}: {plain_s * 1e6:7.1f} / {fused_s * 1e6:7.1f} / "
                f"{separate_s * 1e6:7.1f}")  # fmt: skip
            rows.append({"type": ggml_type.name, "matrix": shape, "fusion": what, "plain_us": plain_s * 1e6,
                         "fused_us": fused_s * 1e6, "separate_us": separate_s * 1e6})  # fmt: skip
    return rows


FUSION_EPS = 1e-5
NORMED_SHAPES = [C(4, 256, 4), C(2, 256, 4), C(8, 256, 4), C(4, 256, 8), C(8, 256, 8), C(16, 256, 8), C(8, 128, 4),
                 C(4, 128, 4), C(4, 256, 2)]  # fmt: skip


def normed_shapes(device: torch.device) -> list[dict[str, object]]:
    """One row, the normed products a Q8_0 step runs (qkv and gate/up, the residual added and normed in the load of
    x, one split), at the launch shapes of NORMED_SHAPES (--sweep times the plain product alone); and the plain o
    projection at --sweep's one-row shapes. us per call in CUDA graphs, weights from HBM."""
    log("\n## Normed products (add + RMS norm in the load of x), one row, us per call (block_n/chunks/warps)")
    rows = []
    for ggml_type in (Q.Q8_0,):
        for shape in ("qkv", "gate_up"):
            n, k = SHAPES[shape]
            residual = torch.randn(1, k, device=device, dtype=torch.bfloat16)
            weight = torch.randn(k, device=device, dtype=torch.bfloat16)
            norm = quant_matmul_triton.Norm(weight=weight, eps=FUSION_EPS, residual=residual)
            calls = [partial(_normed, norm, ggml_type, k, config=c) for c in NORMED_SHAPES]
            _, times, size = timings(ggml_type, n, k, 1, device, calls)
            cells = " ".join(
                f"{c.block_n}/{c.chunks}/{c.num_warps}={t * 1e6:.1f}" for c, t in zip(NORMED_SHAPES, times, strict=True)
            )
            log(f"{ggml_type.name:5s} {shape:8s} normed: {cells}")
            rows.append({"type": ggml_type.name, "matrix": shape, "us": [t * 1e6 for t in times],
                         "configs": [[c.block_n, c.chunks, c.num_warps] for c in NORMED_SHAPES],
                         "gbps": [size / t / 1e9 for t in times]})  # fmt: skip
    n, k = SHAPES["o"]  # the other small product of a layer, plain, at the sweep's one-row shapes
    _, times, size = timings(Q.Q8_0, n, k, 1, device, list(SWEEP[1]))
    cells = " ".join(
        f"{c.block_n}/{c.chunks}/{c.num_warps}{f'/s{c.splits}' if c.splits else ''}={t * 1e6:.1f}"
        for c, t in zip(SWEEP[1], times, strict=True)
    )
    log(f"Q8_0  o        plain : {cells}")
    rows.append({"type": "Q8_0", "matrix": "o", "us": [t * 1e6 for t in times], "gbps": [size / t / 1e9 for t in times],
                 "configs": [[c.block_n, c.chunks, c.num_warps, c.splits] for c in SWEEP[1]]})  # fmt: skip
    return rows


def _add_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, eps: float) -> torch.Tensor:
    return quant_matmul.rms_norm(x + residual, weight, eps)


def _activate(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _gated(gate_up: torch.Tensor, ggml_type: GGMLQuantizationType, k: int, x: torch.Tensor,
           planes: list[torch.Tensor]) -> torch.Tensor:  # fmt: skip
    return quant_matmul_triton.quant_matmul(gate_up, planes, ggml_type, columns=k, gate=quant_matmul.Gate.SILU)


def _activated(activate: Callable[[torch.Tensor], torch.Tensor], gate_up: torch.Tensor,
               ggml_type: GGMLQuantizationType, k: int, x: torch.Tensor,
               planes: list[torch.Tensor]) -> torch.Tensor:  # fmt: skip
    return quant_matmul_triton.quant_matmul(activate(gate_up), planes, ggml_type, columns=k)


def _normed(norm: quant_matmul_triton.Norm, ggml_type: GGMLQuantizationType, k: int, x: torch.Tensor,
            planes: list[torch.Tensor], config: quant_matmul_triton.Config | None = None) -> torch.Tensor:  # fmt: skip
    return quant_matmul_triton.quant_matmul_normed(x, planes, ggml_type, columns=k, norm=norm, config=config)[0]


def _normed_apart(add_norm: Callable[..., torch.Tensor], norm: quant_matmul_triton.Norm,
                  ggml_type: GGMLQuantizationType, k: int, x: torch.Tensor,
                  planes: list[torch.Tensor]) -> torch.Tensor:  # fmt: skip
    return quant_matmul_triton.quant_matmul(add_norm(x, norm.residual, norm.weight), planes, ggml_type, columns=k)


def _kernel_call(
    kernel: Callable[..., torch.Tensor],
    ggml_type: GGMLQuantizationType,
    k: int,
    x: torch.Tensor,
    planes: list[torch.Tensor],
) -> torch.Tensor:
    return kernel(x, planes, ggml_type, columns=k)


GEMM_TILES = ((32, 8, 4), (64, 8, 4), (64, 4, 4), (128, 4, 8), (64, 8, 8))  # block_n, chunks, num_warps
Matmul = Callable[[torch.Tensor, list[torch.Tensor]], torch.Tensor]


def _dequantised(ggml_type: GGMLQuantizationType, k: int) -> Matmul:
    def call(x: torch.Tensor, planes: list[torch.Tensor]) -> torch.Tensor:
        return x @ quant_matmul_triton.dequantize(planes, ggml_type, columns=k, dtype=x.dtype).T

    return call


def _gemm(ggml_type: GGMLQuantizationType, k: int, tile: tuple[int, int, int]) -> Matmul:
    block_n, chunks, warps = tile

    def call(x: torch.Tensor, planes: list[torch.Tensor]) -> torch.Tensor:
        return quant_gemm_triton.quant_gemm(x, planes, ggml_type, columns=k, block_n=block_n, chunks=chunks,
                                            num_warps=warps)  # fmt: skip

    return call


def _save(path: str | None, results: dict[str, object]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
