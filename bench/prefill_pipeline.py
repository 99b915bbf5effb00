"""Time to first token over 1 and 2 stages: a long prefill sent on in pieces (the default) against in one message.

    python bench/prefill_pipeline.py [--lengths 512,4096] [--out DIR]

Stage processes on loopback gRPC, as `strata serve` runs them, driven by the coordinator's client with one prefill
chunk per prompt (the first stage cuts it into STRATA_PIPELINE_CHUNK-position pieces and sends each on as soon as it
is computed). On a GPU: bench/gpu.py's Llama-3-8B-shape file with random Q8_0 weights, both stages on GPU 0 (one per
GPU where there are two). On the CPU: a generated llama of realistic width (bench_llama, 4 layers). Medians of 3
prompts per length, the best of ROUNDS rounds in which the variants take turns; one table naming the machine.
"""

from __future__ import annotations

import argparse
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

ROUNDS = 2
VARIANTS = {  # name -> (stages, STRATA_PIPELINE_CHUNK)
    "1 stage": (1, "512"),
    "2 stages, prefill in one message": (2, "0"),
    "2 stages, prefill in 512-position pieces": (2, "512"),
}


def time_to_first_token(model: Path, *, stages: int, chunk: str, devices: list[str], lengths: list[int],
                        layers: int, vocab: int) -> dict[int, float]:  # fmt: skip
    spans = [(0, layers)] if stages == 1 else [(0, layers // 2), (layers // 2, layers)]
    with ExitStack() as stack:
        port: int | None = None
        for index in reversed(range(stages)):
            port = stack.enter_context(
                gpu.stage_process(
                    model=model,
                    index=index,
                    span=spans[index],
                    device=devices[index],
                    next_port=port,
                    extra_env={"STRATA_PIPELINE_CHUNK": chunk},
                )
            )
        assert port is not None
        wait_loaded(f"127.0.0.1:{port}", timeout_s=600)
        pipeline = Pipeline(f"127.0.0.1:{port}", fence=stage_pb2.Fence(term=1, holder="bench"))
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
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,4096")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda:0" if cuda else "cpu")
    folder = Path(tempfile.mkdtemp(prefix="strata-prefill-"))
    gpu.CONTEXT = max(gpu.CONTEXT, max(lengths) + 256)
    if cuda:
        model = folder / "bench.gguf"
        written = write_bulk_q8_model(model, shape=LARGE_SHAPES["llama3-8b"])
        vocab, description = written.vocab_size, "llama3-8b shape, random Q8_0 weights, bf16 compute"
        layers = LARGE_SHAPES["llama3-8b"].block_count
        count = torch.cuda.device_count()
        devices = [f"cuda:{i % count}" for i in range(2)]
    else:
        shape = bench_llama(layers=4, context_length=8192)
        written = write_test_model(folder / "bench.gguf", architecture="llama", shape=shape)
        model = written.path
        vocab, description = written.vocab_size, "generated llama (bench_llama, 4 layers), f32 compute"
        layers = shape.block_count
        devices = ["cpu", "cpu"]
    results: dict[str, object] = {"machine": gpu.machine(device), "model": description, "kv": gpu.KV.value}
    for round_ in range(ROUNDS):  # the variants take turns, so a busy moment of the machine does not pick one
        for name, (stages, chunk) in VARIANTS.items():
            figures = time_to_first_token(
                model, stages=stages, chunk=chunk, devices=devices, lengths=lengths, layers=layers, vocab=vocab
            )
            print(f"round {round_ + 1}, {name}: {figures}", flush=True)
            best = results.setdefault(name, figures)
            assert isinstance(best, dict)
            results[name] = {n: min(best[n], figures[n]) for n in lengths}
    lines = [
        "machine: " + ", ".join(f"{k} {v}" for k, v in results["machine"].items()),  # type: ignore[attr-defined]
        f"model: {description}; {gpu.KV.value} KV; stages on {devices}",
        "",
        "| time to first token, ms | " + " | ".join(f"{n} tokens" for n in lengths) + " |",
        "| --- |" + " ---: |" * len(lengths),
    ]
    one = results["1 stage"]
    for name in VARIANTS:
        row = results[name]
        assert isinstance(row, dict)
        assert isinstance(one, dict)
        cells = [f"{row[n] * 1e3:.0f} ({row[n] / one[n]:.2f}x)" for n in lengths]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "prefill_pipeline.json").write_text(json.dumps(results, indent=1, default=str))
        (args.out / "prefill_pipeline.md").write_text(table)


if __name__ == "__main__":
    main()
