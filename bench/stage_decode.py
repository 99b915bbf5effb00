"""Decode speed of a pipeline split into 1, 2 and 3 stage processes on loopback, Strata vs HF transformers, and
micro-batches: 4 parallel slots over 2 stages, one step at a time vs two steps in flight.

    .venv/bin/python bench/stage_decode.py [--layers 6] [--tokens 64] [--rounds 3]

Writes a llama model of realistic width (hidden 1024, 16 heads, 8 KV heads, Q8_0/F16 weights) with the shared
test-model generator, starts `strata stage-worker` processes (each stage its own process, as in a cluster), and
greedily decodes one slot. Per-hop latency is the extra median step latency each added stage brings, per hop:
(p50(step, k stages) - p50(step, 1 stage)) / (k - 1); tails are given per configuration, since they do not
subtract. The last row decodes the same file with HF transformers (its own KV cache, same thread count).

Micro-batches: the gateway's driver (strata.gateway.pipeline) on one pair of stage processes with 4 slots generates
`--tokens` greedy tokens in each of 4 slots at once, with micro_batches 1 (one step of 4 slots at a time) and 2 (two
steps of 2 slots in flight, so both stages compute at once), alternating `--rounds` times in one run; aggregate
tokens/s is all slots' tokens over the wall time from submission to the last token (one prefill step included), the
median of the rounds. Stage 0's peak of steps in flight shows whether the stages overlapped. Two pairs of stages:
torch's default threads (the stages share every core, as `strata serve` stages share one device), and one thread
each (a core of its own per stage, as a stage per GPU in a cluster). Prints one table naming the machine.
"""

from __future__ import annotations

import argparse
import asyncio
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
from typing import Any

import grpc
import torch
from strata.gateway.generation import Sampling, Token
from strata.gateway.local import CO_LOCATED_STAGE_ENV
from strata.gateway.pipeline import Pipeline as Driver
from strata.gguf.testmodels import bench_llama, write_test_model
from strata.lease import FencingToken
from strata.rpc.v1 import stage_pb2, stage_pb2_grpc
from strata.stage_worker.client import Pipeline, wait_loaded
from strata_testbed.hf_reference import hf_reference

PROMPT = tuple(range(10, 26))
PARALLEL_SLOTS = 4
CONTEXT = 512  # 4 slots of a 16-token prompt and 64 tokens use 320 cells


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    return f"{platform.node()} ({cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {platform.system()})"


@contextmanager
def stage_process(
    *, model: Path, index: int, span: tuple[int, int], next_port: int | None, parallel: int = 1, threads: int = 0
) -> Iterator[int]:
    env = {
        **CO_LOCATED_STAGE_ENV,
        **os.environ,
        **({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)} if threads else {}),
        "STRATA_STAGE_INDEX": str(index),
        "STRATA_LAYER_START": str(span[0]),
        "STRATA_LAYER_END": str(span[1]),
        "STRATA_MODEL_URL": str(model),
        "STRATA_CONTEXT": str(CONTEXT),
        "STRATA_PARALLEL": str(parallel),
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


async def _parallel_decode(
    port: int,
    *,
    micro_batches: int,
    tokens: int,
    slots: int = PARALLEL_SLOTS,
    context: int = CONTEXT,
    prompt: tuple[int, ...] = PROMPT,
) -> float:
    """All slots generate `tokens` greedy tokens at once through the gateway's driver: aggregate tokens/s."""
    ready = asyncio.Event()
    driver = Driver(
        first_stage=f"127.0.0.1:{port}",
        slots=slots,
        context=context,
        fence=FencingToken(lease_uid="bench", term=1, holder="bench"),
        micro_batches=micro_batches,
        probe_interval_s=0.05,
        on_ready_change=lambda now: ready.set() if now else None,
    )
    await driver.start()
    try:
        try:
            await asyncio.wait_for(ready.wait(), timeout=120)
        except TimeoutError:
            raise TimeoutError(f"the pipeline was not ready after 120 s: {driver.not_ready_reason}") from None
        started = time.perf_counter()
        generations = [
            driver.submit(
                slot=slot,
                prompt=prompt,
                max_tokens=tokens,
                sampling=Sampling(),
                stop_ids=frozenset(),
                on_freed=lambda: None,
            )
            for slot in range(slots)
        ]
        produced = 0
        for generation in generations:
            produced += sum([isinstance(event, Token) async for event in generation.stream()])
        elapsed = time.perf_counter() - started
    finally:
        await driver.close()
    return produced / elapsed


def parallel_decode(port: int, *, micro_batches: int, tokens: int, **shape: Any) -> float:
    """`shape`: slots, context and prompt, when not this bench's own."""
    return asyncio.run(_parallel_decode(port, micro_batches=micro_batches, tokens=tokens, **shape))


def peak_in_flight(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        status = stage_pb2_grpc.StageStub(channel).GetLoadStatus(stage_pb2.LoadStatusRequest(), timeout=10)
    return int(status.steps_in_flight_peak)


def micro_batch_speeds(
    model: Path, *, layers: int, tokens: int, rounds: int, threads: int
) -> tuple[dict[int, float], int]:
    """Median aggregate tokens/s of 4 slots over 2 stages per micro_batches (1, 2), alternating in one run, and
    stage 0's peak of steps in flight afterwards; `threads` per stage (0: torch's default)."""
    with ExitStack() as stack:
        port: int | None = None
        for index, span in reversed(list(enumerate(splits(layers, 2)))):
            port = stack.enter_context(
                stage_process(
                    model=model, index=index, span=span, next_port=port, parallel=PARALLEL_SLOTS, threads=threads
                )
            )
            wait_loaded(f"127.0.0.1:{port}", timeout_s=120)
        assert port is not None
        return alternate_micro_batches(port, tokens=tokens, rounds=rounds)


def alternate_micro_batches(port: int, *, tokens: int, rounds: int, **shape: Any) -> tuple[dict[int, float], int]:
    """On running stages: median aggregate tokens/s per micro_batches (1, 2) over `rounds` alternating rounds after a
    warm-up of each (which also compiles the stages' decode step for both batch sizes), and stage 0's peak of steps
    in flight afterwards. `shape` as for parallel_decode."""
    runs: dict[int, list[float]] = {1: [], 2: []}
    for micro_batches in runs:
        parallel_decode(port, micro_batches=micro_batches, tokens=8, **shape)
    for _ in range(rounds):
        for micro_batches, speeds in runs.items():
            speeds.append(parallel_decode(port, micro_batches=micro_batches, tokens=tokens, **shape))
    return {g: statistics.median(speeds) for g, speeds in runs.items()}, peak_in_flight(port)


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
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of micro_batches 1 and 2")
    args = parser.parse_args()
    if args.layers < 3:
        parser.error(f"--layers {args.layers}: the model is split into up to 3 stages, so it needs at least 3 layers")
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
        grouped = {
            placement: micro_batch_speeds(
                model, layers=args.layers, tokens=args.tokens, rounds=args.rounds, threads=threads
            )
            for placement, threads in (("stages share the cores", 0), ("a core per stage", 1))
        }

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
    print()
    print(
        f"micro-batches: {PARALLEL_SLOTS} slots at once over 2 stages, prompt {len(PROMPT)}, {args.tokens} greedy "
        f"tokens each, gateway driver, median of {args.rounds} alternating rounds"
    )
    print(f"{'stages':<24} {'micro_batches':>13} {'tokens/s':>9} {'vs 1':>6} {'peak in flight':>15}")
    for placement, (speeds, peak) in grouped.items():
        for micro_batches, speed in speeds.items():
            print(f"{placement:<24} {micro_batches:>13} {speed:>9.1f} {speed / speeds[1]:>5.2f}x {peak:>15}")


if __name__ == "__main__":
    main()
