"""Decode speed of a pipeline split into 1, 2 and 3 stage processes on loopback, and Strata vs HF transformers.

    .venv/bin/python bench/stage_decode.py [--layers 6] [--tokens 64]

Writes a llama model of realistic width (hidden 1024, 16 heads, 8 KV heads, Q8_0/F16 weights) with the shared
test-model generator, starts `strata stage-worker` processes (each stage its own process, as in a cluster), and
greedily decodes one slot. Per-hop latency is the extra median step latency each added stage brings, per hop:
(p50(step, k stages) - p50(step, 1 stage)) / (k - 1); tails are given per configuration, since they do not
subtract. The last row decodes the same file with HF transformers (its own KV cache, same thread count). Prints
one table naming the machine.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from strata.gateway.local import CO_LOCATED_STAGE_ENV
from strata.gguf.testmodels import bench_llama, write_test_model
from strata.rpc.v1 import stage_pb2
from strata.stage_worker.client import Pipeline, wait_loaded
from strata_testbed.hf_reference import hf_reference

PROMPT = tuple(range(10, 26))


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    return f"{platform.node()} ({cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {platform.system()})"


@contextmanager
def stage_process(*, model: Path, index: int, span: tuple[int, int], next_port: int | None) -> Iterator[int]:
    env = {
        **CO_LOCATED_STAGE_ENV,
        **os.environ,
        "STRATA_STAGE_INDEX": str(index),
        "STRATA_LAYER_START": str(span[0]),
        "STRATA_LAYER_END": str(span[1]),
        "STRATA_MODEL_URL": str(model),
        "STRATA_CONTEXT": "512",
        "STRATA_PARALLEL": "1",
        "STRATA_CACHE_TYPE_K": "f16",
        "STRATA_CACHE_TYPE_V": "f16",
        "STRATA_NEXT_STAGE": f"127.0.0.1:{next_port}" if next_port else "",
        "STRATA_LISTEN": "127.0.0.1:0",
    }
    command = [sys.executable, "-m", "strata.cli", "stage-worker"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert process.stdout is not None
        match = re.search(r"listening on port (\d+)", process.stdout.readline())
        if match is None:
            raise RuntimeError(f"stage {index} did not start")
        yield int(match.group(1))
    finally:
        process.terminate()
        process.wait(timeout=30)


def splits(layers: int, stages: int) -> list[tuple[int, int]]:
    bounds = [round(i * layers / stages) for i in range(stages + 1)]
    return list(itertools.pairwise(bounds))


def decode_steps(port: int, *, tokens: int) -> tuple[float, list[float]]:
    """Greedy decode of one slot: (tokens per second, per-step latencies in seconds), prefill excluded."""
    pipeline = Pipeline(f"127.0.0.1:{port}", fence=stage_pb2.Fence(term=1, holder="bench"))
    pipeline.claim()
    reply = pipeline.step(
        [stage_pb2.SlotChunk(slot=0, start_position=0, length=len(PROMPT), token_ids=PROMPT, sample=True)]
    )
    token = reply.tokens[0].token_id
    latencies = []
    started = time.perf_counter()
    for position in range(len(PROMPT), len(PROMPT) + tokens):
        begun = time.perf_counter()
        chunk = stage_pb2.SlotChunk(slot=0, start_position=position, length=1, token_ids=[token], sample=True)
        token = pipeline.step([chunk]).tokens[0].token_id
        latencies.append(time.perf_counter() - begun)
    elapsed = time.perf_counter() - started
    pipeline.reset(0)
    return tokens / elapsed, latencies


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1]


def hf_decode(model: Path, *, tokens: int) -> float:
    reference = hf_reference(model)
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        generate = getattr(reference, "generate")  # noqa: B009 (typed as a Tensor in transformers' stubs)
        generate(ids, max_new_tokens=4, do_sample=False)  # warm up
        started = time.perf_counter()
        generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return tokens / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    shape = bench_llama(layers=args.layers)
    rows: list[tuple[str, float, float, float]] = []
    with tempfile.TemporaryDirectory() as folder:
        model = write_test_model(Path(folder) / "bench.gguf", architecture="llama", shape=shape).path
        size_mb = model.stat().st_size / 1e6
        speeds: dict[int, float] = {}
        p50: dict[int, float] = {}
        p99: dict[int, float] = {}
        for stages in (1, 2, 3):
            with ExitStack() as stack:
                port: int | None = None
                for index, span in reversed(list(enumerate(splits(args.layers, stages)))):
                    port = stack.enter_context(stage_process(model=model, index=index, span=span, next_port=port))
                    wait_loaded(f"127.0.0.1:{port}", timeout_s=120)
                assert port is not None
                decode_steps(port, tokens=8)  # warm up
                speeds[stages], latencies = decode_steps(port, tokens=args.tokens)
                p50[stages], p99[stages] = percentile(latencies, 50) * 1e3, percentile(latencies, 99) * 1e3
            rows.append(
                (f"strata, {stages} stage{'s' if stages > 1 else ''}", speeds[stages], p50[stages], p99[stages])
            )
        hf_speed = hf_decode(model, tokens=args.tokens)

    print(f"machine: {machine()}")
    print(f"model: llama, {args.layers} layers, hidden 1024, ffn 2816, 16 heads / 8 KV heads, {size_mb:.0f} MB GGUF")
    print(f"decode: 1 slot, prompt {len(PROMPT)}, {args.tokens} greedy tokens, f16 KV cache, f32 compute on CPU\n")
    print(f"{'run':<22} {'tokens/s':>9} {'step p50 ms':>12} {'step p99 ms':>12}")
    for name, speed, s50, s99 in rows:
        print(f"{name:<22} {speed:>9.1f} {s50:>12.2f} {s99:>12.2f}")
    print(f"{'hf transformers':<22} {hf_speed:>9.1f}")
    print()
    # Medians subtract; tails do not (the slowest steps of two runs are different steps), so the tail is each
    # configuration's own step p99 above, not a per-hop figure.
    for stages in (2, 3):
        hop50 = (p50[stages] - p50[1]) / (stages - 1)
        kept = speeds[stages] / speeds[1] * 100
        print(f"{stages} stages: {kept:.0f}% of one stage's speed; per hop p50 {hop50:.2f} ms")
    print(f"strata 1 stage vs hf transformers: {speeds[1] / hf_speed:.2f}x")


if __name__ == "__main__":
    main()
