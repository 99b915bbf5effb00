"""Decode-step variants side by side on one GPU: CUDA graphs alone, and CUDA graphs over a torch.compile'd step.

    python bench/decode_compile.py [--shape llama3-8b|tiny]

One model of real shape with random Q8_0 weights, loaded once; each variant first decodes 16 steps fed HF
transformers' f32 greedy picks (how many picks agree, the largest log-probability gap: the same check as
bench/gpu.py's fidelity, and the time of those steps, compilation included), then decodes greedily with 1, 4 and 16
slots. The table gives tokens/s and the share of the bandwidth roofline.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from strata.gguf.testmodels.bulk import write_bulk_q8_model
from strata.stage_worker.decode import Decoder
from strata.stage_worker.engine import Engine
from strata_testbed.hf_reference import hf_from_stage

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu  # the GPU bench's loaders and measures, shared

# (name, torch.compile: "" for none, "static" or "dynamic" shapes)
VARIANTS = (
    ("CUDA graphs", ""),
    ("CUDA graphs + compiled block, static shapes", "static"),
    ("CUDA graphs + compiled block, dynamic shapes", "dynamic"),
)


def engine(model: torch.nn.Module, *, device: torch.device, dtype: torch.dtype, compiled: str) -> Engine:
    built = gpu.engine_for(model, device=device, dtype=dtype, graphs=device.type == "cuda", compiled=False)
    if compiled:
        built.decoder = Decoder(
            model=built.model, pool=built.pool, rope=built.rope, dtype=dtype, graphs=device.type == "cuda",
            compiled=True, dynamic=compiled == "dynamic",
        )  # fmt: skip
    return built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(gpu.SHAPES), default=None)
    parser.add_argument("--model", type=Path, default=Path("strata-bench-model.gguf"))
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda:0" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = gpu.SHAPES[args.shape or ("llama3-8b" if cuda else "tiny")]
    gpu.log(f"machine: {gpu.machine(device)}")
    bandwidth = gpu.copy_bandwidth(device)
    written = write_bulk_q8_model(args.model, shape=shape)
    model = gpu.load(args.model, span=(0, shape.block_count), device=device, dtype=dtype)
    weights = gpu.weight_bytes(model)
    kv_per_position = shape.block_count * 2 * shape.head_count_kv * shape.head_dim * gpu.KV_BYTES_PER_VALUE
    reference32 = hf_from_stage(gpu.load(args.model, span=(0, shape.block_count), device=device, dtype=torch.float32))
    tokens = gpu.prompt(64, vocab=written.vocab_size, seed=7)
    rows = []
    for name, compiled in VARIANTS:
        e = engine(model, device=device, dtype=dtype, compiled=compiled)
        started = time.perf_counter()
        agree, gap, steps = gpu.decode_agreement(e, reference32, tokens=tokens, device=device)
        warm = time.perf_counter() - started
        check = f"{agree}/{steps} picks, logprob gap {gap:.3f}"
        gpu.log(f"{name}: 16 steps incl. compilation {warm:.1f} s, {check} against HF f32")
        figures, warmups = {}, {}
        for slots in gpu.SLOTS:
            begun = time.perf_counter()
            rate, latencies = gpu.engine_decode(e, slots=slots, steps=64)
            warmups[slots] = time.perf_counter() - begun - sum(latencies)
            mean_position = gpu.DECODE_PROMPT + 8 + 32
            roof = slots * bandwidth / (weights + slots * mean_position * kv_per_position)
            figures[slots] = (rate, rate / roof, statistics.median(latencies) * 1e3)
            gpu.log(f"{name}, {slots} slots: {rate:.1f} tok/s ({rate / roof:.0%} of roofline)")
        gpu.log(f"{name}: prefill + 8 warm-up steps (compilation included) per slot count, s: {warmups}")
        rows.append((name, warm, check, figures))
        del e
    print(f"\nmachine: {gpu.machine(device)}; copy {bandwidth / 1e12:.2f} TB/s; weights {weights / 1e9:.2f} GB/step")
    print("| variant | 16 steps incl. compile, s | decode fed HF f32's picks | " +
          " | ".join(f"{s} slot(s): tok/s, roofline, p50 ms" for s in gpu.SLOTS) + " |")  # fmt: skip
    print("| --- | ---: | ---: | " + " | ".join("---:" for _ in gpu.SLOTS) + " |")
    for name, warm, check, figures in rows:
        cells = " | ".join(f"{r:.1f}, {share:.0%}, {p50:.2f}" for r, share, p50 in figures.values())
        print(f"| {name} | {warm:.1f} | {check} | {cells} |")


if __name__ == "__main__":
    main()
