"""Time to first token over 1 and 2 stages: both stages in one process (what `strata serve` runs for stages that
share a device: the activations handed over in memory, the prefill whole), and two stage processes with the
activations through shared memory (the default between processes on one host) against inline over gRPC, a long
prefill sent on in pieces (the default between processes) against in one message.

    python bench/prefill_pipeline.py [--lengths 512,4096] [--rounds 2] [--layers N] [--variants KEYS] [--out DIR]

Stage processes on loopback gRPC, as `strata serve` runs them, driven by the coordinator's client with one prefill
chunk per prompt (between processes the first stage cuts it into STRATA_PIPELINE_CHUNK-position pieces and sends each
on as soon as it is computed; in one process it stays whole). On a GPU: bench/gpu.py's Llama-3-8B-shape file with
random Q8_0 weights (`--layers` keeps fewer of its layers), both stages on GPU 0 (one per GPU where there are two,
except in one process, which takes GPU 0). On the CPU: a generated llama of realistic width (bench_llama, 4 layers).
Medians of 3 prompts per length, the best of `--rounds` rounds in which the variants take turns; one table naming the
machine, printed (and written to --out) after every variant, so a run cut short still reports what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch
from strata.gguf.testmodels import LARGE_SHAPES, bench_llama, write_test_model
from strata.gguf.testmodels.bulk import write_bulk_q8_model
from strata.rpc.v1 import stage_pb2
from strata.stage_worker.client import Pipeline, wait_loaded

sys.path.insert(0, str(Path(__file__).parent))
import gpu

ONE_PROCESS = "2 stages, one process"  # STRATA_SPLIT_AT: the second stage takes the first's tensor, the prefill whole
VARIANTS = {  # name -> stages, and the stages' environment; the most telling first, for a run cut short
    "1 stage": (1, {}),
    ONE_PROCESS: (2, {}),
    "2 stages, pieces, shared memory": (2, {"STRATA_PIPELINE_CHUNK": "512", "STRATA_HOP_SLOTS": "4"}),
    "2 stages, pieces, inline": (2, {"STRATA_PIPELINE_CHUNK": "512", "STRATA_HOP_SLOTS": "0"}),
    "2 stages, one message, inline": (2, {"STRATA_PIPELINE_CHUNK": "0", "STRATA_HOP_SLOTS": "0"}),
}
KEYS = dict(zip(("one-stage", "one-process", "shared", "inline", "whole"), VARIANTS, strict=True))  # for --variants
# As `strata serve` starts stages on one machine (strata.gateway.local): idle OpenMP threads must not spin on the
# cores the working stage needs.
CO_LOCATED = {"OMP_WAIT_POLICY": "PASSIVE"}


def time_to_first_token(model: Path, *, stages: int, env: dict[str, str], devices: list[str], lengths: list[int],
                        layers: int, vocab: int, one_process: bool = False) -> dict[int, float]:  # fmt: skip
    spans = [(0, layers)] if stages == 1 else [(0, layers // 2), (layers // 2, layers)]
    with ExitStack() as stack:
        ports: list[int] = []
        if one_process:
            ports = stack.enter_context(
                gpu.stage_ports(
                    model=model, index=0, span=(0, layers), device=devices[0], next_port=None,
                    extra_env={**CO_LOCATED, **env}, split_at=(layers // 2,),
                )
            )  # fmt: skip
        for index in reversed(range(0 if one_process else stages)):
            port = stack.enter_context(
                gpu.stage_process(
                    model=model,
                    index=index,
                    span=spans[index],
                    device=devices[index],
                    next_port=ports[0] if ports else None,
                    extra_env={**CO_LOCATED, **env},
                )
            )
            ports.insert(0, port)
        for port in ports:
            wait_loaded(f"127.0.0.1:{port}", timeout_s=600)
        pipeline = Pipeline(f"127.0.0.1:{ports[0]}", fence=stage_pb2.Fence(term=1, holder="bench"))
        pipeline.claim()
        figures = {}
        for length in [lengths[0], *lengths]:  # the first prompt warms up
            times = []
            for r in range(3):
                tokens = gpu.prompt(length, vocab=vocab, seed=100 + r)
                pipeline.reset(0)
                started = time.perf_counter()
                chunk_msg = stage_pb2.SlotChunk(slot=0, length=length, token_ids=tokens, sample=True)
                pipeline.step([chunk_msg])
                times.append(time.perf_counter() - started)
            figures[length] = statistics.median(times)
        pipeline.reset(0)
        pipeline.link.close()
        if stages > 1:  # how the activations came, as the last stage counted them
            last = wait_loaded(f"127.0.0.1:{ports[-1]}", timeout_s=10)
            print(
                f"  activations: {last.activations_in_process} steps in process, {last.activations_shared} shared, "
                f"{last.activations_inline} inline"
            )
    return figures


def report(best: dict[str, dict[int, float]], *, machine: dict[str, str], description: str, devices: list[str],
           lengths: list[int], out: Path | None) -> None:  # fmt: skip
    lines = [
        "machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()),
        f"model: {description}; {gpu.KV.value} KV; stages on {devices}",
        "",
        "| time to first token, ms | " + " | ".join(f"{n} tokens" for n in lengths) + " |",
        "| --- |" + " ---: |" * len(lengths),
    ]
    one = best["1 stage"]
    for name, row in best.items():
        cells = [f"{row[n] * 1e3:.0f} ({row[n] / one[n]:.2f}x)" for n in lengths]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    print(table, flush=True)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        results = {"machine": machine, "model": description, "kv": gpu.KV.value, **best}
        (out / "prefill_pipeline.json").write_text(json.dumps(results, indent=1, default=str))
        (out / "prefill_pipeline.md").write_text(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,4096")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, default=0, help="GPU: keep this many of the 8B shape's 32 layers")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--variants",
        default=",".join(KEYS),
        help=f"which to run, comma-separated, one-stage among them ({', '.join(KEYS)})",
    )
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    chosen = args.variants.split(",")
    unknown = [key for key in chosen if key not in KEYS]
    if unknown or "one-stage" not in chosen:
        known = ", ".join(KEYS)
        parser.error(f"--variants {args.variants!r}: give one-stage and any of {known}; unknown: {unknown}")
    variants = {KEYS[key]: VARIANTS[KEYS[key]] for key in KEYS if key in chosen}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        gpu.STAGE_LOG = args.out / "stages.log"
    cuda = torch.cuda.is_available()
    device = torch.device("cuda:0" if cuda else "cpu")
    folder = Path(tempfile.mkdtemp(prefix="strata-prefill-"))
    gpu.CONTEXT = max(gpu.CONTEXT, max(lengths) + 256)
    if cuda:
        model = folder / "bench.gguf"
        shape = LARGE_SHAPES["llama3-8b"]
        shape = dataclasses.replace(shape, block_count=args.layers or shape.block_count)
        written = write_bulk_q8_model(model, shape=shape)
        layers = shape.block_count
        vocab, description = written.vocab_size, f"llama3-8b shape, {layers} layers, random Q8_0 weights, bf16 compute"
        count = torch.cuda.device_count()
        devices = [f"cuda:{i % count}" for i in range(2)]
    else:
        shape = bench_llama(layers=4, context_length=8192)
        written = write_test_model(folder / "bench.gguf", architecture="llama", shape=shape)
        model = written.path
        vocab, description = written.vocab_size, "generated llama (bench_llama, 4 layers), f32 compute"
        layers = shape.block_count
        devices = ["cpu", "cpu"]
    machine = gpu.machine(device)
    best: dict[str, dict[int, float]] = {}
    for round_ in range(args.rounds):  # the variants take turns, so a busy moment of the machine does not pick one
        for name, (stages, env) in variants.items():
            figures = time_to_first_token(
                model, stages=stages, env=env, devices=devices, lengths=lengths, layers=layers, vocab=vocab,
                one_process=name == ONE_PROCESS,
            )  # fmt: skip
            print(f"round {round_ + 1}, {name}: {figures}", flush=True)
            best[name] = {n: min(best.get(name, figures)[n], figures[n]) for n in lengths}
            report(best, machine=machine, description=description, devices=devices, lengths=lengths, out=args.out)


if __name__ == "__main__":
    main()
