"""Strata on GPUs (or the CPU): decode, aggregate, time to first token and per-hop latency, against the memory-bandwidth
roofline and against HF transformers on the same weights. One run, one table.

    python bench/gpu.py [--shape llama3-8b|tiny] [--out DIR]

Writes a model of real shape with random Q8_0 weights where it runs (no weights can be downloaded), measures the
device's copy bandwidth, checks the GPU path's fidelity against HF transformers in f32, then measures:

- in-process engine (no gRPC): decode tokens/s with 1, 4 and 16 slots (compiled blocks in CUDA graphs; 1 slot eagerly
  and with CUDA graphs alone too), and time to
  first token for 512- and 4,096-token prompts (one prefill chunk);
- the served path: `strata stage-worker` processes on loopback gRPC, 1 stage, then 2 stages (one per GPU when there
  are two), with the coordinator's client; per-hop latency = p50 step (2 stages) - p50 step (1 stage);
- micro-batches: the gateway's driver over the 2 stages with every slot generating, one step of all slots at a time
  against two steps of half the slots in flight (both stages computing at once);
- HF transformers (LlamaForCausalLM, sdpa, bf16) on the same GPU with the same dequantised weights, assigned directly
  (its GGUF loader dequantises 8B parameters in numpy, too slowly for one run).

Roofline for decode: bandwidth / bytes read per step (every weight but the embedding once in the compute dtype, plus
each slot's KV cells in the cache type).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from strata.gguf import read_header
from strata.gguf.model import CacheType
from strata.gguf.sources import open_source
from strata.gguf.testmodels import LARGE_SHAPES
from strata.gguf.testmodels.bulk import write_bulk_q8_model
from strata.rpc.v1 import stage_pb2
from strata.stage_worker.client import Pipeline, wait_loaded
from strata.stage_worker.engine import Chunk, Engine
from strata.stage_worker.kv_pool import KVPool
from strata.stage_worker.loader import LoadProgress, load_stage
from strata.stage_worker.model import StageModel
from strata_testbed.hf_reference import hf_from_stage

SHAPES = {
    "llama3-8b": LARGE_SHAPES["llama3-8b"],
    "tiny": dataclasses.replace(
        LARGE_SHAPES["llama3-8b"], block_count=2, embedding_length=256, feed_forward_length=512, head_count=4,
        head_count_kv=2, head_dim=64, vocab_size=4096,
    ),
}  # fmt: skip
CONTEXT = 8192
PARALLEL = 16
SLOTS = (1, 4, 16)
DECODE_PROMPT = 300
DECODE_STEPS = 128
TTFT_PROMPTS = (512, 4096)
# The served first token of a 4,096-token prompt sent as the gateway sends it, this many tokens a step, beside the
# whole prompt in one step: a step of more than GEMM_MAX_ROWS rows dequantises each matrix for cuBLAS, so the chunk
# size decides how often a long prompt pays that. The gateway's default (256), the widest it takes today (the plan's
# UBATCH_TOKENS, 512), and what a plan of 2,048-row steps would buy.
GATEWAY_CHUNKS = (256, 512, 2048)
KV = CacheType.Q8_0
KV_BYTES_PER_VALUE = 34 / 32
# `strata stage-worker` without the other subcommands (the bench machine carries only the stage worker's packages).
STAGE_MAIN = (
    "import argparse, sys; from strata.stage_worker import command; p = argparse.ArgumentParser(); "
    "command.register(p.add_subparsers()); a = p.parse_args(['stage-worker']); sys.exit(a.run(a))"
)
STAGE_LOG: Path | None = None  # where stage processes' logs go (--out/stages.log)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def machine(device: torch.device) -> dict[str, str]:
    import transformers

    info = {
        "host": platform.node(),
        "cpu": f"{platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    if device.type == "cuda":
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["gpus"] = f"{len(names)} x {names[0]}"
        info["cuda"] = str(torch.version.cuda)
        try:
            query = ["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"]
            info["driver"] = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            info["driver"] = "unknown"
    return info


def copy_bandwidth(device: torch.device, *, gib: float = 2.0, repeats: int = 20) -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read plus bytes written."""
    n = int(gib * (1 << 30))
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    started = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    sync(device)
    return 2 * n * repeats / (time.perf_counter() - started)


def load(path: Path, *, span: tuple[int, int], device: torch.device, dtype: torch.dtype) -> StageModel:
    source = open_source(str(path))
    try:
        header = read_header(source)
        return load_stage(
            source=source, header=header, layer_start=span[0], layer_end=span[1], dtype=dtype, device=device,
            progress=LoadProgress(),
        )  # fmt: skip
    finally:
        source.close()


def engine_for(
    model: StageModel, *, device: torch.device, dtype: torch.dtype, graphs: bool, compiled: bool | None = None
) -> Engine:
    c = model.config
    pool = KVPool(
        n_layers=len(model.layers), context=CONTEXT, parallel=PARALLEL, key_width=c.kv_dim, value_width=c.kv_dim,
        type_k=KV, type_v=KV, dtype=dtype, device=device,
    )  # fmt: skip
    return Engine(model=model, pool=pool, device=device, dtype=dtype, cuda_graphs=graphs, compiled=compiled)


def prompt(length: int, *, vocab: int, seed: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, vocab, (length,), generator=g).tolist())


# The in-process engine.


def engine_prefill(engine: Engine, *, slot: int, tokens: tuple[int, ...]) -> tuple[int, float]:
    engine.pool.reset(slot)
    sync(engine.device)
    started = time.perf_counter()
    chunk = Chunk(slot=slot, start_position=0, length=len(tokens), token_ids=tokens, sample=True)
    token = engine.step([chunk], None).tokens[slot].token_id
    return token, time.perf_counter() - started


def engine_decode(engine: Engine, *, slots: int, steps: int) -> tuple[float, list[float]]:
    """Aggregate tokens/s and step latencies of `slots` greedy streams, after a prefill and a warm-up."""
    vocab = engine.model.config.vocab_size
    last = {
        s: engine_prefill(engine, slot=s, tokens=prompt(DECODE_PROMPT, vocab=vocab, seed=s))[0] for s in range(slots)
    }
    position = DECODE_PROMPT
    latencies = []
    for i in range(8 + steps):
        chunks = [
            Chunk(slot=s, start_position=position, length=1, token_ids=(t,), sample=True) for s, t in last.items()
        ]
        begun = time.perf_counter()
        tokens = engine.step(chunks, None).tokens
        if i >= 8:
            latencies.append(time.perf_counter() - begun)
        last = {s: tokens[s].token_id for s in last}
        position += 1
    for s in range(slots):
        engine.pool.reset(s)
    return slots * len(latencies) / sum(latencies), latencies


# The served path: stage processes over loopback gRPC.


def micro_batch_speeds(
    model: Path, *, spans: list[tuple[int, int]], devices: list[str], vocab: int, rounds: int = 3
) -> dict[str, float]:
    """Aggregate tokens/s of PARALLEL slots over the stages through the gateway's driver, one step of every slot at
    a time (micro_batches 1) against two steps of half the slots in flight (2), alternating; medians."""
    import stage_decode  # the CPU bench's driver loop, shared

    shape = {"slots": PARALLEL, "context": CONTEXT, "prompt": prompt(DECODE_PROMPT, vocab=vocab, seed=3)}
    with ExitStack() as stack:
        port: int | None = None
        for index in reversed(range(len(spans))):
            port = stack.enter_context(
                stage_process(model=model, index=index, span=spans[index], device=devices[index], next_port=port)
            )
        assert port is not None
        wait_loaded(f"127.0.0.1:{port}", timeout_s=600)
        speeds, peak = stage_decode.alternate_micro_batches(port, tokens=64, rounds=rounds, **shape)
    return {f"micro_batches_{g}": speed for g, speed in speeds.items()} | {"peak_in_flight": peak}


@contextmanager
def stage_process(
    *,
    model: Path,
    index: int,
    span: tuple[int, int],
    device: str,
    next_port: int | None,
    extra_env: dict[str, str] | None = None,
) -> Iterator[int]:
    with stage_ports(
        model=model, index=index, span=span, device=device, next_port=next_port, extra_env=extra_env
    ) as ports:
        yield ports[0]


@contextmanager
def stage_ports(
    *,
    model: Path,
    index: int,
    span: tuple[int, int],
    device: str,
    next_port: int | None,
    extra_env: dict[str, str] | None = None,
    split_at: tuple[int, ...] = (),
) -> Iterator[list[int]]:
    """A stage-worker process over `span`, split into stages of one process at `split_at`; each stage's port."""
    env = {
        **os.environ,
        **(extra_env or {}),
        "STRATA_STAGE_INDEX": str(index), "STRATA_LAYER_START": str(span[0]), "STRATA_LAYER_END": str(span[1]),
        "STRATA_MODEL_URL": str(model), "STRATA_CONTEXT": str(CONTEXT), "STRATA_PARALLEL": str(PARALLEL),
        "STRATA_CACHE_TYPE_K": KV.value, "STRATA_CACHE_TYPE_V": KV.value, "STRATA_DEVICE": device,
        "STRATA_NEXT_STAGE": f"127.0.0.1:{next_port}" if next_port else "", "STRATA_LISTEN": "127.0.0.1:0",
        "STRATA_SPLIT_AT": ",".join(map(str, split_at)),
    }  # fmt: skip
    command = [sys.executable, "-c", STAGE_MAIN]
    errors = STAGE_LOG.open("a") if STAGE_LOG else subprocess.DEVNULL
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=errors, text=True)
    try:
        ports = []
        for stage in range(index, index + len(split_at) + 1):
            line = process.stdout.readline() if process.stdout else ""
            match = re.search(r"listening on port (\d+)", line)
            if match is None:
                raise RuntimeError(f"stage {stage} did not start: {line!r}")
            ports.append(int(match.group(1)))
        yield ports
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()  # a stage that ignores SIGTERM must not hide the error that got us here
            process.wait(timeout=30)


def served(model: Path, *, spans: list[tuple[int, int]], devices: list[str], vocab: int) -> dict[str, object]:
    figures: dict[str, object] = {}
    with ExitStack() as stack:
        ports: list[int] = []
        started = time.perf_counter()
        for index in reversed(range(len(spans))):
            ports.insert(
                0,
                stack.enter_context(
                    stage_process(
                        model=model,
                        index=index,
                        span=spans[index],
                        device=devices[index],
                        next_port=ports[0] if ports else None,
                    )
                ),
            )
        for port in ports:
            wait_loaded(f"127.0.0.1:{port}", timeout_s=600)
        port = ports[0]
        figures["load_s"] = time.perf_counter() - started
        pipeline = Pipeline(f"127.0.0.1:{port}", fence=stage_pb2.Fence(term=1, holder="bench"))
        pipeline.claim()

        def prefill(slot: int, tokens: tuple[int, ...], chunk: int = 0) -> tuple[int, float]:
            """The first token of `tokens` and its time, prefilled `chunk` tokens a step (0: in one step)."""
            pipeline.reset(slot)
            started = time.perf_counter()
            width = chunk or len(tokens)
            for start in range(0, len(tokens), width):
                ids = tokens[start : start + width]
                last = start + len(ids) == len(tokens)
                reply = pipeline.step(
                    [stage_pb2.SlotChunk(slot=slot, start_position=start, length=len(ids), token_ids=ids, sample=last)]
                )
            return reply.tokens[0].token_id, time.perf_counter() - started

        for slots in SLOTS:
            last = {s: prefill(s, prompt(DECODE_PROMPT, vocab=vocab, seed=s))[0] for s in range(slots)}
            position, latencies = DECODE_PROMPT, []
            for i in range(8 + DECODE_STEPS):
                chunks = [
                    stage_pb2.SlotChunk(slot=s, start_position=position, length=1, token_ids=[t], sample=True)
                    for s, t in last.items()
                ]
                begun = time.perf_counter()
                reply = pipeline.step(chunks)
                if i >= 8:
                    latencies.append(time.perf_counter() - begun)
                last = {t.slot: t.token_id for t in reply.tokens}
                position += 1
            for s in range(slots):
                pipeline.reset(s)
            figures[f"decode_{slots}"] = slots * len(latencies) / sum(latencies)
            figures[f"step_p50_ms_{slots}"] = statistics.median(latencies) * 1e3
        for length in TTFT_PROMPTS:
            times = [prefill(0, prompt(length, vocab=vocab, seed=100 + r))[1] for r in range(3)]
            figures[f"ttft_{length}"] = statistics.median(times)
        for chunk in GATEWAY_CHUNKS:
            times = [prefill(0, prompt(4096, vocab=vocab, seed=100 + r), chunk)[1] for r in range(3)]
            figures[f"ttft_4096_chunks_{chunk}"] = statistics.median(times)
        pipeline.reset(0)
        pipeline.link.close()
    return figures


# HF transformers on the same weights.


def hf_figures(model: torch.nn.Module, *, device: torch.device, vocab: int) -> dict[str, float]:
    generate = getattr(model, "generate")  # noqa: B009 (typed as a Tensor in transformers' stubs)
    figures: dict[str, float] = {}

    def run(batch: int, length: int, new: int) -> float:
        ids = torch.tensor([prompt(length, vocab=vocab, seed=s) for s in range(batch)], device=device)
        sync(device)
        started = time.perf_counter()
        with torch.inference_mode():
            generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        sync(device)
        return time.perf_counter() - started

    run(1, 16, 4)  # warm up
    for batch in SLOTS:
        first = statistics.median(run(batch, DECODE_PROMPT, 1) for _ in range(2))
        whole = run(batch, DECODE_PROMPT, DECODE_STEPS + 1)
        figures[f"decode_{batch}"] = batch * DECODE_STEPS / (whole - first)
    for length in TTFT_PROMPTS:
        figures[f"ttft_{length}"] = statistics.median(run(1, length, 1) for _ in range(3))
    return figures


# Fidelity: the GPU path against HF in f32, with HF in bf16 as the yardstick for bf16 rounding.


def relative(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float(((ours.float() - reference.float()).norm(dim=-1) / reference.float().norm(dim=-1)).max())


def decode_agreement(
    engine: Engine, reference32: torch.nn.Module, *, tokens: tuple[int, ...], device: torch.device, steps: int = 16
) -> tuple[int, float, int]:
    """Decode through the batched (graph) path, fed HF f32's greedy picks: (steps where Strata picks the same,
    largest gap between the two log-probabilities of Strata's pick, steps)."""
    engine.pool.reset(0)
    engine.step([Chunk(slot=0, start_position=0, length=len(tokens) - 1, token_ids=tokens[:-1])], None)
    agree, logprob_gap = 0, 0.0
    sequence = list(tokens)
    for _ in range(steps):
        step = Chunk(slot=0, start_position=len(sequence) - 1, length=1, token_ids=(sequence[-1],), sample=True)
        picked = engine.step([step], None).tokens[0]
        with torch.inference_mode():
            logits = reference32(torch.tensor([sequence], device=device)).logits[0, -1].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        best = int(torch.argmax(logprobs))
        agree += int(picked.token_id == best)
        logprob_gap = max(logprob_gap, abs(picked.logprob - float(logprobs[picked.token_id])))
        sequence.append(best)
    engine.pool.reset(0)
    return agree, logprob_gap, steps


def fidelity(path: Path, engine: Engine, hf_bf16: torch.nn.Module, *, device: torch.device) -> dict[str, object]:
    vocab = engine.model.config.vocab_size
    tokens = prompt(64, vocab=vocab, seed=7)
    reference32 = hf_from_stage(load(path, span=(0, engine.model.config.n_layer), device=device, dtype=torch.float32))
    ids = torch.tensor([tokens], device=device)
    with torch.inference_mode():
        expected = reference32(ids).logits[0].float()  # [T, vocab]
        hf16 = hf_bf16(ids).logits[0].float()
    engine.pool.reset(0)
    chunk = Chunk(slot=0, start_position=0, length=len(tokens), token_ids=tokens, return_logits=True)
    ours = engine.step([chunk], None).logits[0]
    # The same prompt in two chunks: the second attends over cached positions too (lower-right causal mask).
    half = len(tokens) // 2
    engine.pool.reset(0)
    engine.step([Chunk(slot=0, start_position=0, length=half, token_ids=tokens[:half])], None)
    second = Chunk(slot=0, start_position=half, length=len(tokens) - half, token_ids=tokens[half:], return_logits=True)
    chunked = engine.step([second], None).logits[0]
    agree, logprob_gap, steps = decode_agreement(engine, reference32, tokens=tokens, device=device)
    del reference32
    if device.type == "cuda":
        torch.cuda.empty_cache()
    strata_error, hf_error = relative(ours, expected), relative(hf16, expected)
    chunked_error = relative(chunked, expected[half:])
    tolerance = max(2e-2, 1.5 * hf_error)
    return {
        "strata_bf16_vs_hf_f32": strata_error,
        "strata_bf16_two_chunks_vs_hf_f32": chunked_error,
        "hf_bf16_vs_hf_f32": hf_error,
        "tolerance": tolerance,
        "decode_agree": f"{agree}/{steps}",
        "decode_logprob_gap": logprob_gap,
        "passed": max(strata_error, chunked_error) <= tolerance and agree >= steps * 3 // 4,
    }


def weight_bytes(model: StageModel) -> int:
    """Bytes of the tensors a decode step reads: every parameter and quantised plane but the embedding table."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return sum(t.numel() * t.element_size() for name, t in tensors if not name.startswith("token_embd"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None)
    parser.add_argument("--model", type=Path, default=Path("strata-bench-model.gguf"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--skip-served", action="store_true")
    args = parser.parse_args()
    global STAGE_LOG
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        STAGE_LOG = args.out / "stages.log"
    cuda = torch.cuda.is_available()
    device = torch.device("cuda:0" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = SHAPES[args.shape or ("llama3-8b" if cuda else "tiny")]
    results: dict[str, object] = {
        "machine": machine(device), "shape": shape.name, "layers": shape.block_count, "dtype": str(dtype)[6:],
    }  # fmt: skip
    log(f"machine: {results['machine']}")
    results["copy_bandwidth"] = bandwidth = copy_bandwidth(device)
    log(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")

    args.model.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    written = write_bulk_q8_model(args.model, shape=shape)
    results["write_s"] = time.perf_counter() - started
    results["file_gb"] = args.model.stat().st_size / 1e9
    log(f"wrote {args.model} ({results['file_gb']:.2f} GB) in {results['write_s']:.0f} s")

    started = time.perf_counter()
    model = load(args.model, span=(0, shape.block_count), device=device, dtype=dtype)
    sync(device)
    results["load_s"] = time.perf_counter() - started
    results["weight_bytes"] = weights = weight_bytes(model)
    log(f"loaded in {results['load_s']:.1f} s; {weights / 1e9:.2f} GB of weights read per step")
    engine = engine_for(model, device=device, dtype=dtype, graphs=cuda)
    hf_bf16 = hf_from_stage(model)  # shares the stage's tensors (q/k un-permuted copies)
    results["fidelity"] = fidelity(args.model, engine, hf_bf16, device=device)
    log(f"fidelity: {results['fidelity']}")

    vocab = written.vocab_size
    kv_per_position = shape.block_count * 2 * shape.head_count_kv * shape.head_dim * KV_BYTES_PER_VALUE
    strata: dict[str, float] = {}
    for slots in SLOTS:
        strata[f"decode_{slots}"], latencies = engine_decode(engine, slots=slots, steps=DECODE_STEPS)
        strata[f"step_p50_ms_{slots}"] = statistics.median(latencies) * 1e3
        mean_position = DECODE_PROMPT + 8 + DECODE_STEPS / 2
        step_bytes = weights + slots * mean_position * kv_per_position
        strata[f"roofline_{slots}"] = slots * bandwidth / step_bytes
        log(f"strata {slots} slots: {strata[f'decode_{slots}']:.1f} tok/s (roofline {strata[f'roofline_{slots}']:.0f})")
    eager = engine_for(model, device=device, dtype=dtype, graphs=False)
    strata["eager_decode_1"], _ = engine_decode(eager, slots=1, steps=32)
    del eager
    if cuda:
        plain = engine_for(model, device=device, dtype=dtype, graphs=True, compiled=False)
        strata["graphs_only_decode_1"], _ = engine_decode(plain, slots=1, steps=DECODE_STEPS)
        del plain
    for length in TTFT_PROMPTS:
        strata[f"ttft_{length}"] = statistics.median(
            engine_prefill(engine, slot=0, tokens=prompt(length, vocab=vocab, seed=100 + r))[1] for r in range(3)
        )
    results["strata"] = strata
    log(f"strata in-process: {strata}")
    results["hf"] = hf_figures(hf_bf16, device=device, vocab=vocab)
    log(f"hf: {results['hf']}")
    del engine, hf_bf16, model
    if cuda:
        torch.cuda.empty_cache()

    if not args.skip_served:
        gpus = torch.cuda.device_count() if cuda else 0
        devices = [f"cuda:{i % max(gpus, 1)}" for i in range(2)] if cuda else ["cpu", "cpu"]
        half = shape.block_count // 2
        try:
            results["served_1"] = served(args.model, spans=[(0, shape.block_count)], devices=devices[:1], vocab=vocab)
        except Exception as exc:  # report the in-process figures even when the served path fails
            log(f"served path failed: {exc!r}")
            results["served_error"] = repr(exc)
            print(render(results))
            raise
        log(f"served, 1 stage: {results['served_1']}")
        results["served_2"] = served(
            args.model, spans=[(0, half), (half, shape.block_count)], devices=devices, vocab=vocab
        )
        results["served_2_devices"] = devices
        log(f"served, 2 stages on {devices}: {results['served_2']}")
        results["micro_batches"] = micro_batch_speeds(
            args.model, spans=[(0, half), (half, shape.block_count)], devices=devices, vocab=vocab
        )
        log(f"micro-batches, 2 stages, {PARALLEL} slots: {results['micro_batches']}")

    table = render(results)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str))
        (args.out / "table.md").write_text(table)


def render(r: dict[str, object]) -> str:
    s, h = r["strata"], r["hf"]
    assert isinstance(s, dict)
    assert isinstance(h, dict)
    m, f = r["machine"], r["fidelity"]
    assert isinstance(m, dict)
    assert isinstance(f, dict)
    bw = float(r["copy_bandwidth"])  # type: ignore[arg-type]
    lines = [
        "machine: " + ", ".join(f"{k} {v}" for k, v in m.items()),
        f"model: {r['shape']} ({r['layers']} layers), random Q8_0 weights, {r['file_gb']:.2f} GB file, "
        f"{r['dtype']} compute ({int(r['weight_bytes']) / 1e9:.2f} GB read per decode step), "  # type: ignore[call-overload]
        f"q8_0 KV, context {CONTEXT}, {PARALLEL} slots",
        f"copy bandwidth (read + write): {bw / 1e12:.2f} TB/s; file written in {r['write_s']:.0f} s, "
        f"loaded in {r['load_s']:.1f} s",
        f"fidelity (prompt logits, max relative L2 vs HF f32): strata {r['dtype']} {f['strata_bf16_vs_hf_f32']:.4f} "
        f"(in two chunks {f['strata_bf16_two_chunks_vs_hf_f32']:.4f}), "
        f"HF {r['dtype']} {f['hf_bf16_vs_hf_f32']:.4f}, tolerance {f['tolerance']:.4f}; decode picks agree "
        f"{f['decode_agree']}, max logprob gap {f['decode_logprob_gap']:.4f} -> {'PASS' if f['passed'] else 'FAIL'}",
        "",
        "| figure | strata (engine) | strata served, 1 stage | strata served, 2 stages | HF transformers | roofline |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    one, two = r.get("served_1", {}), r.get("served_2", {})
    assert isinstance(one, dict)
    assert isinstance(two, dict)

    def cell(d: dict[str, float], key: str, fmt: str) -> str:
        return format(d[key], fmt) if key in d else "-"

    for slots in SLOTS:
        name = "decode tokens/s, 1 stream" if slots == 1 else f"aggregate tokens/s, {slots} slots"
        roof = s[f"roofline_{slots}"]
        share = f"{cell(s, f'decode_{slots}', '.1f')} ({s[f'decode_{slots}'] / roof:.0%})"
        lines.append(
            f"| {name} | {share} | {cell(one, f'decode_{slots}', '.1f')} | {cell(two, f'decode_{slots}', '.1f')} | "
            f"{cell(h, f'decode_{slots}', '.1f')} | {roof:.0f} |"
        )
    lines.append(f"| decode tokens/s, 1 stream, eager (no CUDA graphs) | {s['eager_decode_1']:.1f} | | | | |")
    if "graphs_only_decode_1" in s:
        plain = s["graphs_only_decode_1"]
        lines.append(f"| decode tokens/s, 1 stream, CUDA graphs without compiled blocks | {plain:.1f} | | | | |")
    for length in TTFT_PROMPTS:
        key = f"ttft_{length}"
        lines.append(
            f"| time to first token, {length}-token prompt, ms | {s[key] * 1e3:.0f} | "
            f"{cell({k: v * 1e3 for k, v in one.items() if k == key}, key, '.0f')} | "
            f"{cell({k: v * 1e3 for k, v in two.items() if k == key}, key, '.0f')} | {h[key] * 1e3:.0f} | |"
        )
    lines.append(
        f"| decode step p50, 1 slot, ms | {s['step_p50_ms_1']:.2f} | {cell(one, 'step_p50_ms_1', '.2f')} | "
        f"{cell(two, 'step_p50_ms_1', '.2f')} | | |"
    )
    if "step_p50_ms_1" in one and "step_p50_ms_1" in two:
        for slots in SLOTS:
            hop = two[f"step_p50_ms_{slots}"] - one[f"step_p50_ms_{slots}"]
            lines.append(f"| per-hop latency, {slots} slot(s) (2 stages - 1 stage), ms | | | {hop:.2f} | | |")
        lines.append(f"\n2 stages on {r.get('served_2_devices')}; stage load {two.get('load_s', 0):.0f} s")
    micro = r.get("micro_batches")
    if isinstance(micro, dict):
        one_step, two_steps = micro["micro_batches_1"], micro["micro_batches_2"]
        lines.append(
            f"gateway driver, 2 stages, {PARALLEL} slots, aggregate tokens/s: micro_batches 1 {one_step:.1f}, "
            f"micro_batches 2 {two_steps:.1f} ({two_steps / one_step:.2f}x; peak steps in flight "
            f"{micro['peak_in_flight']})"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
