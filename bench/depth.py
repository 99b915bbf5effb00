"""Decode at the context lengths agents use: Strata's in-process engine against llama.cpp on the same file and GPU.

    python bench/depth.py [--peer .peer/llama-src.tar.xz] [--out DIR] [--depths 300,4096,...] [--resident-window N]

One run, one table: the pool attention kernel against its reference on the table of named cases (bf16, f16 and f32
on the GPU); then, on a Llama-3-8B-shape file with random Q8_0 weights (bench/gpu.py's), single-stream decode
tokens/s after D positions for each depth, with q8_0 and f16 KV, and 16 streams at 4,096 positions each; then
llama.cpp built from the source carried in the tree (bench/llamacpp.py) on the same file: `llama-bench -d D` and
`llama-batched-bench -npp 4096 -npl 16`. With `--resident-window N` (default 4096; 0: none), one stream with q8_0 KV
decodes over a resident window of N positions (spec.kvCache.residentWindow) at 4K, 32K, 64K and 128K: the window's
decode at depth over its own at 4K is issue 24's figure (aim: within 10%).

Strata's slots are filled to depth D with random K/V written through the pool's own quantiser (attention's cost does
not depend on the values, and a 128K-token prefill per depth would spend the lease on prefill); llama.cpp fills its
cache by prefilling D tokens, as llama-bench does. Both then decode greedily: Strata 64 steps after 8 warm-up steps,
llama.cpp `-n 64`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from strata.gguf.model import CacheType
from strata.gguf.testmodels import LARGE_SHAPES
from strata.gguf.testmodels.bulk import write_bulk_q8_model
from strata.kv_layout import ResidentBudget
from strata.stage_worker.engine import Chunk, Engine
from strata.stage_worker.kv_pool import KVPool
from strata.stage_worker.kv_resident import ResidentShape
from strata.stage_worker.model import StageModel
from strata.stage_worker.stage_load import keep_resident
from strata_testbed.attention_cases import CASES, INT8_CASES, run_case, tolerance

if TYPE_CHECKING:
    from strata.stage_worker.kernels.paged_attention_triton import LaunchConfig

sys.path.insert(0, str(Path(__file__).parent))
import gpu
import llamacpp

DEPTHS = (300, 4096, 8192, 16384, 32768, 131072)
F16_DEPTHS = (300, 4096, 8192, 16384, 32768)
STEPS = 64
WARM = 8
STREAMS = 16
STREAM_DEPTH = 4096
RESIDENT_DEPTHS = (4096, 32768, 65536, 131072)
KERNEL_DTYPES = (torch.bfloat16, torch.float32)  # bf16: the GPUs' compute dtype; f32: the exact path


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def _gpu_variants() -> dict[str, LaunchConfig]:
    from strata.stage_worker.kernels.paged_attention_triton import LaunchConfig

    # The default takes the PTX conversion for lone launches with cells a tile ahead; these take it elsewhere too.
    return {
        "int8 four a register in every launch": LaunchConfig(packed_int8=True),
        "int8 four a register in every launch, cells in their own tile": LaunchConfig(
            packed_int8=True, cells_ahead=False
        ),
    }


def kernel_fidelity(device: torch.device) -> list[dict[str, object]]:
    from strata.stage_worker.kernels.paged_attention import round_q_int8
    from strata.stage_worker.kernels.paged_attention_triton import LaunchConfig

    rows = []
    for case in CASES:
        for dtype in KERNEL_DTYPES:
            error = run_case(case, device=device, dtype=dtype, seed=1)
            rows.append({"case": case.name, "dtype": str(dtype)[6:], "error": error, "ok": error <= tolerance(dtype)})
    # Launches that differ from the default on a GPU only (PTX the interpreter does not run), on every case
    for name, variant in _gpu_variants().items():
        for case in CASES:
            error = run_case(case, device=device, dtype=torch.bfloat16, seed=1, launch=variant)
            row = {"case": f"{case.name}, {name}", "dtype": "bf16", "error": error}
            rows.append({**row, "ok": error <= tolerance(torch.bfloat16)})
    # Integer scores (LaunchConfig.int8_scores, bf16 q only): the attention of q rounded to int8 to bf16's accuracy,
    # and within bf16's bound of the exact q's (tests/stage_worker/test_paged_attention.py, on the CPU, in f16).
    launch, bound = LaunchConfig(int8_scores=True), tolerance(torch.bfloat16)
    for case in INT8_CASES:
        rounded = run_case(case, device=device, dtype=torch.bfloat16, seed=1, launch=launch, reference_q=round_q_int8)
        exact = run_case(case, device=device, dtype=torch.bfloat16, seed=1, launch=launch)
        row = {"case": f"{case.name}, int8 scores", "dtype": "bf16+int8", "error": exact, "rounded_q_error": rounded}
        rows.append({**row, "ok": max(exact, rounded) <= bound})
    return rows


def kernel_speed(device: torch.device, *, depths: list[int], only: Sequence[str] = ()) -> dict[str, float]:
    """One layer's decode attention alone (Llama-3-8B heads, q8_0 KV), replayed from a CUDA graph: achieved GB/s of
    K/V read, for one stream at each depth and 16 streams at 4,096, under each launch configuration tried (those
    named in `only`, where it names any)."""
    import triton.testing
    from strata.stage_worker.kernels import paged_attention_triton as kernels

    base = kernels.DEFAULT
    configs = {
        "default": base,
        "64-position tiles, 2 warps": dataclasses.replace(base, lone_block_n=64, num_warps=2),
        "16-position tiles": dataclasses.replace(base, lone_block_n=16, block_n=32),
        "3 stages": dataclasses.replace(base, num_stages=3),
        "256 splits": dataclasses.replace(base, waves=16, max_splits=256),
        "256 splits, 3 stages": dataclasses.replace(base, waves=16, max_splits=256, num_stages=3),
        "512 splits": dataclasses.replace(base, waves=32, max_splits=512),
        "64 splits": dataclasses.replace(base, waves=4, max_splits=64),
        "64-position tiles, 1 warp": dataclasses.replace(base, lone_block_n=64, num_warps=1),
        "64-position tiles, 1 warp, 3 stages": dataclasses.replace(base, lone_block_n=64, num_warps=1, num_stages=3),
        "4 stages": dataclasses.replace(base, num_stages=4),
        "128-position tiles, 4 warps": dataclasses.replace(base, lone_block_n=128, num_warps=4),
        "64 splits, 64-position tiles, 2 warps": dataclasses.replace(
            base, waves=4, max_splits=64, lone_block_n=64, num_warps=2
        ),
        # The default's decode launch takes 255 registers a thread and spills: a program of one warp holds the whole
        # [16, 128] f32 accumulator and both tiles. These split them over more warps and take 128-136, no spills, so a
        # multiprocessor holds twice the warps; on an H200 (2026-11-29) all were slower at every depth (32K: 68.6 us
        # against 53.4), so registers do not bound the kernel; the warps' exchanges through shared memory cost more.
        "32-position tiles, 4 warps": dataclasses.replace(base, num_warps=4),
        "32-position tiles, 4 warps, 3 stages": dataclasses.replace(base, num_warps=4, num_stages=3),
        "32-position tiles, 4 warps, 256 splits": dataclasses.replace(base, num_warps=4, waves=16, max_splits=256),
        "32-position tiles everywhere, 4 warps": dataclasses.replace(base, block_n=32, num_warps=4),
        "16-position tiles, 2 warps": dataclasses.replace(base, lone_block_n=16, block_n=16, num_warps=2),
        "16-position tiles, 4 warps": dataclasses.replace(base, lone_block_n=16, block_n=16, num_warps=4),
        "64-position tiles, 8 warps": dataclasses.replace(base, lone_block_n=64, num_warps=8),
        # Scores as integer products of q rounded to int8 and the stored K: 13-15% fewer instructions a tile, compiled
        # offline (bench/sass.py); on an H100 (2026-12-07) one stream was 5-11% slower at depth, 16 streams 5.5% faster
        "integer scores": dataclasses.replace(base, int8_scores=True),
        # ... the lone stream's tile on 1 warp spills 48 bytes with them (offline); 64 positions on 2 warps does not
        "integer scores, lone 64-position tiles, 2 warps": dataclasses.replace(
            base, int8_scores=True, lone_block_n=64, num_warps=2
        ),
        # ... and with one stage the lone tile keeps everything in registers (offline: no stack, 1,531 instructions;
        # the default's tile with one stage: 1,790, no stack)
        "integer scores, 1 stage": dataclasses.replace(base, int8_scores=True, num_stages=1),
        "1 stage": dataclasses.replace(base, num_stages=1),
        # The merge of the splits over a whole head a program (before 2026-12-07), and a lone stream on two stages
        "whole-head merge": dataclasses.replace(base, merge_values=1 << 20),
        "whole-head merge, lone stream on 2 stages": dataclasses.replace(base, merge_values=1 << 20, lone_stages=2),
        # The launches timed against each other on 2026-12-07 (the default now takes both for lone launches)
        "plain loads and conversion": dataclasses.replace(base, cells_ahead=False, lone_packed_int8=False),
        "cells a tile ahead": dataclasses.replace(base, lone_packed_int8=False),
        "int8 four a register": dataclasses.replace(base, cells_ahead=False),
        "int8 four a register in every launch": dataclasses.replace(base, packed_int8=True),
    }
    if unknown := set(only) - set(configs):
        raise SystemExit(f"--configs: unknown launches {sorted(unknown)}; known: {', '.join(configs)}")
    configs = {name: config for name, config in configs.items() if not only or name in only}
    shapes = [(1, d) for d in depths] + [(STREAMS, STREAM_DEPTH)]
    speeds = {}
    for streams, depth in shapes:
        pool = filled_pool(device, streams=streams, depth=depth)
        q = torch.randn(streams, 32, 128, device=device, dtype=torch.bfloat16)
        arguments = attention_arguments(pool, streams=streams, q_len=1, kv_len=depth)
        for name, config in configs.items():
            attend = functools.partial(kernels.paged_attention, q, config=config, **arguments)
            ms = triton.testing.do_bench_cudagraph(attend, return_mode="median")
            key = f"{streams}x{depth} {name}"
            speeds[key] = pool.cell_bytes * depth * streams / (ms * 1e-3) / 1e9
            log(f"kernel alone, {key}: {ms * 1e3:.1f} us, {speeds[key]:.0f} GB/s of q8_0 K/V")
        del pool
    for fn in (kernels._attend_split, kernels._merge_splits):
        for line in compiled_kernels(fn):
            log(f"compiled {fn.__name__}: {line}")
    return speeds


def filled_pool(device: torch.device, *, streams: int, depth: int) -> KVPool:
    """One layer of Llama-3-8B's K/V (8 heads of 128, q8_0), `streams` slots of `depth` random positions each."""
    pool = KVPool(
        n_layers=1, context=streams * depth + 1, parallel=streams, key_width=1024, value_width=1024,
        type_k=CacheType.Q8_0, type_v=CacheType.Q8_0, dtype=torch.bfloat16, device=device,
    )  # fmt: skip
    for slot in range(streams):
        cells = pool.extend(slot=slot, start_position=0, length=depth).full.new
        for at in range(0, depth, 16384):  # in parts: 128K positions of f32 K/V at once would take 1 GB more
            part = cells[at : at + 16384]
            pool.layers[0].write(
                part, torch.randn(len(part), 1024, device=device), torch.randn(len(part), 1024, device=device)
            )
    return pool


def attention_arguments(pool: KVPool, *, streams: int, q_len: int, kv_len: int) -> dict[str, object]:
    """`paged_attention`'s arguments but q and the launch: `streams` slots of `q_len` query rows each (consecutive in
    q), each seeing `kv_len` positions of `filled_pool`'s layer."""
    store_k, store_v = pool.layers[0].keys, pool.layers[0].values
    slots = torch.arange(streams, device=pool.table.device)
    return {
        "keys": store_k.values, "key_scales": store_k.scales, "values": store_v.values,
        "value_scales": store_v.scales, "table": pool.table, "slots": slots, "q_starts": slots * q_len,
        "q_lens": torch.full_like(slots, q_len), "kv_lens": torch.full_like(slots, kv_len), "max_q_len": q_len,
        "n_head_kv": 8, "scale": 128**-0.5,
    }  # fmt: skip


CHUNKS = ((0, 4096), (4096, 4096), (28672, 4096), (126976, 4096), (3840, 256), (32512, 256))  # (prefix, chunk)


def chunk_speed(device: torch.device) -> dict[str, float]:
    """One layer's attention over a prefill chunk after a prefix (a second turn, a prefix-cache hit, a long prompt in
    chunks; Llama-3-8B heads, q8_0 KV), µs a call, under today's launch and with 64 query rows a program (the
    rule before 2026-11-29)."""
    import triton.testing
    from strata.stage_worker.kernels import paged_attention_triton as kernels

    configs = {"default": kernels.DEFAULT, "64 rows a program": dataclasses.replace(kernels.DEFAULT, chunk_rows=64)}
    times = {}
    for prefix, chunk in CHUNKS:
        pool = filled_pool(device, streams=1, depth=prefix + chunk)
        q = torch.randn(chunk, 32, 128, device=device, dtype=torch.bfloat16)
        arguments = attention_arguments(pool, streams=1, q_len=chunk, kv_len=prefix + chunk)
        for name, config in configs.items():
            attend = functools.partial(kernels.paged_attention, q, config=config, **arguments)
            key = f"{chunk} after {prefix} {name}"
            times[key] = triton.testing.do_bench_cudagraph(attend, return_mode="median") * 1e3
            log(f"kernel alone, a chunk of {chunk} after {prefix} positions, {name}: {times[key]:.1f} us")
        del pool
    return times


def compiled_kernels(fn: object) -> list[str]:
    """Registers, spills and shared memory of each variant of a Triton kernel compiled so far (what sets how many
    programs a multiprocessor holds)."""
    lines = []
    for cache in getattr(fn, "device_caches", {}).values():
        compiled = cache[0] if isinstance(cache, tuple) else cache
        for variant in getattr(compiled, "values", lambda: [])():
            meta = getattr(variant, "metadata", None)
            constants = {k: v for k, v in getattr(variant, "constants", {}).items() if isinstance(v, (int, bool))}
            lines.append(
                f"regs {getattr(variant, 'n_regs', '?')}, spills {getattr(variant, 'n_spills', '?')}, "
                f"shared {getattr(meta, 'shared', '?')}, warps {getattr(meta, 'num_warps', '?')}, "
                f"stages {getattr(meta, 'num_stages', '?')} {constants}"
            )
    return lines


def fill(engine: Engine, *, slot: int, depth: int, generator: torch.Generator) -> None:
    """Give `slot` `depth` positions of random K/V in every layer, written through the pool's quantiser."""
    pool = engine.pool
    pool.reset(slot)
    cells = pool.extend(slot=slot, start_position=0, length=depth).full.new
    c = engine.model.config
    for layer in pool.layers:
        for start in range(0, depth, 16384):
            part = cells[start : start + 16384]
            k = torch.randn(part.shape[0], c.kv_dim, generator=generator, device=pool.device, dtype=engine.dtype)
            v = torch.randn(part.shape[0], c.kv_dim, generator=generator, device=pool.device, dtype=engine.dtype)
            layer.write(part, k, v)


def decode_speed(engine: Engine, *, depths: dict[int, int]) -> float:
    """Aggregate tokens/s of greedy decode from slot -> depth, after `fill`: STEPS steps back to back, timed from the
    return of the last warm-up step to the return of the last step, as a stream decodes. (A sync before each step
    would time only the host's part of a step launched ahead: strata.stage_worker.decode_ahead.)"""
    positions = dict(depths)
    tokens = dict.fromkeys(depths, 1)
    begun = 0.0
    for i in range(WARM + STEPS):
        chunks = [
            Chunk(slot=s, start_position=p, length=1, token_ids=(tokens[s],), sample=True) for s, p in positions.items()
        ]
        picked = engine.step(chunks, None).tokens
        if i == WARM - 1:
            begun = time.perf_counter()
        tokens = {s: picked[s].token_id for s in positions}
        positions = {s: p + 1 for s, p in positions.items()}
    return len(depths) * STEPS / (time.perf_counter() - begun)


def one_stream(engine: Engine, depths: Sequence[int], *, generator: torch.Generator, label: str) -> dict[str, float]:
    """Decode tokens/s of slot 0 after each depth (filled by `fill`, emptied after)."""
    speeds: dict[str, float] = {}
    for depth in depths:
        fill(engine, slot=0, depth=depth, generator=generator)
        speeds[str(depth)] = decode_speed(engine, depths={0: depth})
        engine.pool.reset(0)
        log(f"strata {label}, depth {depth}: {speeds[str(depth)]:.1f} tok/s")
    return speeds


def resident_sweep(model: StageModel, *, window: int, device: torch.device) -> dict[str, float]:
    """One stream, q8_0 KV, decoding over a resident window of `window` positions after each of RESIDENT_DEPTHS
    (its first choice, and the bounds of every block it reads, happen in the warm-up steps; the timed steps cross a
    block boundary, so they include a choice)."""
    c = model.config
    pool = KVPool(
        n_layers=c.n_layer, context=max(RESIDENT_DEPTHS) + WARM + STEPS + 256, parallel=1, key_width=c.kv_dim,
        value_width=c.kv_dim, type_k=CacheType.Q8_0, type_v=CacheType.Q8_0, dtype=torch.bfloat16, device=device,
    )  # fmt: skip
    shape = ResidentShape.of(ResidentBudget(tokens=window), block=pool.block)
    keep_resident(pool, c, layers=range(c.n_layer), shape=shape)
    engine = Engine(model=model, pool=pool, device=device, dtype=torch.bfloat16)
    engine.warm_up()
    generator = torch.Generator(device=device).manual_seed(0)
    speeds = one_stream(engine, RESIDENT_DEPTHS, generator=generator, label=f"q8_0 KV, resident window {window}")
    del engine, pool
    torch.cuda.empty_cache()
    return speeds


def strata_sweep(
    model_path: Path, *, depths: list[int], device: torch.device, resident_window: int
) -> dict[str, dict[str, float]]:
    shape_layers = LARGE_SHAPES["llama3-8b"].block_count
    model = gpu.load(model_path, span=(0, shape_layers), device=device, dtype=torch.bfloat16)
    c = model.config
    results: dict[str, dict[str, float]] = {}
    generator = torch.Generator(device=device).manual_seed(0)
    for cache in (CacheType.Q8_0, CacheType.F16):
        wanted = [d for d in depths if cache is CacheType.Q8_0 or d in F16_DEPTHS]
        context = max([*wanted, STREAMS * (STREAM_DEPTH + WARM + STEPS)]) + WARM + STEPS + 256
        pool = KVPool(
            n_layers=c.n_layer, context=context, parallel=STREAMS, key_width=c.kv_dim, value_width=c.kv_dim,
            type_k=cache, type_v=cache, dtype=torch.bfloat16, device=device,
        )  # fmt: skip
        engine = Engine(model=model, pool=pool, device=device, dtype=torch.bfloat16)
        engine.warm_up()
        speeds = one_stream(engine, wanted, generator=generator, label=f"{cache.value} KV")
        for slot in range(STREAMS):
            fill(engine, slot=slot, depth=STREAM_DEPTH, generator=generator)
        speeds[f"{STREAMS}x{STREAM_DEPTH}"] = decode_speed(engine, depths=dict.fromkeys(range(STREAMS), STREAM_DEPTH))
        log(f"strata {cache.value} KV, {STREAMS} streams at {STREAM_DEPTH}: {speeds[f'{STREAMS}x{STREAM_DEPTH}']:.1f}")
        results[cache.value] = speeds
        del engine, pool
        torch.cuda.empty_cache()
    if resident_window:
        results["q8_0 resident"] = resident_sweep(model, window=resident_window, device=device)
    del model
    torch.cuda.empty_cache()
    return results


def peer_sweep(bin_dir: Path, model_path: Path, *, depths: list[int]) -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, float]] = {}
    for cache in ("q8_0", "f16"):
        wanted = [d for d in depths if cache == "q8_0" or d in F16_DEPTHS]
        speeds = llamacpp.decode_at_depth(
            bin_dir, model_path, depths=wanted, cache_type=cache, tokens=STEPS, repetitions=1, timeout_s=400
        )
        figures = {str(d): s for d, s in speeds.items()}
        batched = llamacpp.batched(
            bin_dir, model_path, prompt=STREAM_DEPTH, generate=STEPS, parallel=[STREAMS], cache_type=cache,
            context=STREAMS * (STREAM_DEPTH + STEPS) + 256, timeout_s=300,
        )  # fmt: skip
        figures[f"{STREAMS}x{STREAM_DEPTH}"] = batched[STREAMS]["S_TG"]
        results[cache] = figures
        log(f"llama.cpp {cache} KV: {figures}")
    return results


def machine_line(machine: object) -> str:
    assert isinstance(machine, dict)
    return "machine: " + ", ".join(f"{k} {v}" for k, v in machine.items())


def render(r: dict[str, object]) -> str:
    machine, strata, peer = r["machine"], r["strata"], r.get("llamacpp", {})
    assert isinstance(machine, dict)
    assert isinstance(strata, dict)
    assert isinstance(peer, dict)
    lines = [
        machine_line(machine),
        f"model: llama3-8b shape, random Q8_0 weights ({r['file_gb']:.2f} GB file) kept in their blocks, bf16 "
        f"compute; decode {STEPS} greedy steps after {WARM} warm-up; copy bandwidth {r['bandwidth'] / 1e12:.2f} TB/s",
        f"pool attention kernel vs reference: {r['kernel_passed']} of {r['kernel_cases']} case x dtype checks pass "
        f"(worst bf16 error {r['kernel_worst_bf16']:.2e})",
        "",
        "| depth | Strata q8_0 KV | / its 300 | llama.cpp q8_0 | / its 300 | ratio | Strata f16 KV | llama.cpp f16 "
        "| ratio |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    keys = [k for k in strata.get("q8_0", {}) if k.isdigit()]
    for key in [*keys, f"{STREAMS}x{STREAM_DEPTH}"]:
        cells = [key if key.isdigit() else f"{STREAMS} streams x {STREAM_DEPTH}"]
        for cache in ("q8_0", "f16"):
            ours, theirs = strata.get(cache, {}).get(key), peer.get(cache, {}).get(key)
            cells.append(f"{ours:.1f}" if ours else "-")
            if cache == "q8_0":
                base = strata[cache].get("300")
                peer_base = peer.get(cache, {}).get("300")
                cells.append(f"{ours / base:.2f}" if ours and base and key.isdigit() else "")
                cells.append(f"{theirs:.1f}" if theirs else "-")
                cells.append(f"{theirs / peer_base:.2f}" if theirs and peer_base and key.isdigit() else "")
            else:
                cells.append(f"{theirs:.1f}" if theirs else "-")
            cells.append(f"{ours / theirs:.2f}x" if ours and theirs else "")
        lines.append("| " + " | ".join(cells) + " |")
    resident = strata.get("q8_0 resident")
    if resident:
        base = resident[str(RESIDENT_DEPTHS[0])]
        lines += [
            "",
            f"One stream, q8_0 KV, over a resident window of {r['resident_window']} positions:",
            "",
            "| depth | Strata, resident window | / its 4096 | Strata, every position | llama.cpp q8_0 |",
            "| ---: | ---: | ---: | ---: | ---: |",
        ]
        for key, ours in resident.items():
            full, theirs = strata.get("q8_0", {}).get(key), peer.get("q8_0", {}).get(key)
            lines.append(
                f"| {key} | {ours:.1f} | {ours / base:.2f} | {f'{full:.1f}' if full else '-'} | "
                f"{f'{theirs:.1f}' if theirs else '-'} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path(tempfile.gettempdir()) / "strata-bench-model.gguf")
    parser.add_argument("--peer", type=Path, default=Path(".peer/llama-src.tar.xz"))
    parser.add_argument("--peer-work", type=Path, default=Path(tempfile.gettempdir()) / "strata-llamacpp")
    parser.add_argument("--depths", default=",".join(map(str, DEPTHS)))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--kernel-only",
        action="store_true",
        help="the kernel's checks and speed alone (decode, and chunks after a prefix)",
    )
    parser.add_argument("--no-checks", action="store_true", help="skip the kernel's checks (tuning runs only)")
    parser.add_argument(
        "--configs", default="", help="--kernel-only: the launches to time, by name, separated by ';' (default: all)"
    )
    parser.add_argument(
        "--resident-window", type=int, default=4096, help="tokens of the resident window's sweep (0: no such sweep)"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/depth.py measures a GPU; on the CPU, pytest tests/stage_worker/test_paged_attention.py checks "
                 "the same kernel under Triton's interpreter")  # fmt: skip
    device = torch.device("cuda:0")
    depths = [int(d) for d in args.depths.split(",")]
    # llama.cpp builds on the CPUs (niced) while Strata measures on the GPU; its benches run after Strata's.
    peer_build = None
    if args.peer.exists() and not args.kernel_only:
        peer_build = llamacpp.build_in_background(args.peer, work=args.peer_work)
    results: dict[str, object] = {"machine": gpu.machine(device), "bandwidth": gpu.copy_bandwidth(device)}
    started = time.perf_counter()
    checks = [] if args.no_checks else kernel_fidelity(device)
    failed = [c for c in checks if not c["ok"]]
    results["kernel"] = checks
    results["kernel_cases"], results["kernel_passed"] = len(checks), len(checks) - len(failed)
    results["kernel_worst_bf16"] = max((float(c["error"]) for c in checks if c["dtype"] == "bfloat16"), default=0.0)  # type: ignore[arg-type]
    log(f"kernel checks in {time.perf_counter() - started:.0f} s; failed: {failed or 'none'}")
    for check in checks:
        print(
            f"  {check['case']:52s} {check['dtype']:9s} {float(check['error']):.2e} {'ok' if check['ok'] else 'FAIL'}"
        )  # type: ignore[arg-type]
    if args.kernel_only:
        log(f"{machine_line(results['machine'])}; copy bandwidth {float(results['bandwidth']) / 1e12:.2f} TB/s")  # type: ignore[arg-type]
        only = [name.strip() for name in args.configs.split(";") if name.strip()]
        results["kernel_speed"] = kernel_speed(device, depths=depths, only=only)
        results["chunk_speed"] = chunk_speed(device)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "kernel.json").write_text(json.dumps(results, indent=1, default=str))
        return
    if not args.model.exists():
        write_bulk_q8_model(args.model, shape=LARGE_SHAPES["llama3-8b"])
    results["file_gb"] = args.model.stat().st_size / 1e9
    results["resident_window"] = args.resident_window
    results["strata"] = strata_sweep(args.model, depths=depths, device=device, resident_window=args.resident_window)
    if peer_build is not None:
        try:
            results["llamacpp"] = peer_sweep(llamacpp.built(peer_build), args.model, depths=depths)
        except (subprocess.SubprocessError, RuntimeError, OSError) as exc:
            log(f"llama.cpp failed: {exc}")
            print(exc)
            results["llamacpp_error"] = str(exc)
    else:
        log(f"no llama.cpp source at {args.peer} (python bench/llamacpp.py prepare .peer): Strata alone")
    table = render(results)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "depth.json").write_text(json.dumps(results, indent=1, default=str))
        (args.out / "depth.md").write_text(table)
    if failed:
        sys.exit(f"{len(failed)} kernel checks failed")


if __name__ == "__main__":
    main()
