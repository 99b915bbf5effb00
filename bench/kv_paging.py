"""The paged KV pool and its host tier on one device: block copy bandwidth each way, decode of the paged pool against
the contiguous layout, and time to first token of a long prompt restored from the host tier against recomputed.

    python bench/kv_paging.py [--device cuda|cpu] [--ttft-tokens 131072] [--decode-depth 4096] [--out FILE.json]

One command, one table naming the machine (issue 24's figures):
- host<->device: a stage's KV blocks (64 positions over every layer, Llama-3-8B shape, q8_0: 4.5 MB a block) moved
  by the host tier (strata.stage_worker.kv_host: pinned memory and a copy stream on CUDA) each way, in GB/s;
- decode tokens/s of one stream after `--decode-depth` positions, in the paged pool (64-position blocks) and in the
  same engine with one block spanning the whole context (the contiguous layout), with depth.py's fill and step loop;
- time to first token of a `--ttft-tokens` prompt: prefilled whole (in chunks of `--prefill-chunk`), and restored
  from the host tier (its block-aligned prefix moved there by the prefix cache, then the rest prefilled); both give
  the same first token or the run fails.

On a GPU the model is a generated Llama-3-8B-shape file with random Q8_0 weights (bench/gpu.py's, as depth.py);
`--device cpu` takes a small generated llama and small sizes, so the script can be checked anywhere. Every phase
runs under a deadline (`--phase-timeout-s`), and the whole run under `--timeout-s`: a phase past its deadline stops
the run with a message naming it.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import TypeVar

import torch
from strata.gguf.model import CacheType
from strata.gguf.testmodels import LARGE_SHAPES, write_test_model
from strata.gguf.testmodels.bulk import write_bulk_q8_model
from strata.kv_layout import BLOCK_TOKENS
from strata.stage_worker.engine import Chunk, Engine
from strata.stage_worker.kv_host import HostTier
from strata.stage_worker.kv_pool import KVPool
from strata.stage_worker.model import StageModel
from strata.stage_worker.prefix_cache import PrefixCache
from strata.stage_worker.settings import default_dtype

sys.path.insert(0, str(Path(__file__).parent))
import depth
import gpu

KV = CacheType.Q8_0
T = TypeVar("T")


class PhaseTimeout(RuntimeError):
    """A phase ran past its deadline."""


@contextmanager
def deadline(phase: str, seconds: float) -> Iterator[None]:
    """Stop the run with PhaseTimeout naming `phase` when it takes longer than `seconds` (SIGALRM: main thread)."""

    def expired(_signum: int, _frame: FrameType | None) -> None:
        raise PhaseTimeout(f"{phase} ran past its deadline of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def timed(device: torch.device, work: Callable[[], T]) -> tuple[T, float]:
    gpu.sync(device)
    started = time.perf_counter()
    result = work()
    gpu.sync(device)
    return result, time.perf_counter() - started


def pool_for(model: StageModel, *, context: int, parallel: int, device: torch.device, block: int) -> KVPool:
    c = model.config
    return KVPool(
        n_layers=len(model.layers), context=context, parallel=parallel, key_width=c.kv_dim, value_width=c.kv_dim,
        type_k=KV, type_v=KV, dtype=default_dtype(device), device=device, block=block,
    )  # fmt: skip


def block_bandwidth(model: StageModel, *, device: torch.device, blocks: int, repeats: int) -> dict[str, float]:
    """GB/s of `blocks` whole blocks (every layer's K and V rows, as stored) to the host tier and back."""
    pool = pool_for(model, context=blocks * BLOCK_TOKENS, parallel=1, device=device, block=BLOCK_TOKENS)
    host = HostTier(budget_bytes=1 << 62, device=device)
    # Every block of every store: one contiguous range each, as a prefix the allocator handed out in order is.
    rows = [store.view(0, pool.full.cells) for layer in pool.layers for store in (layer.keys, layer.values)]
    nbytes = sum(r.nbytes for r in rows)
    out, back = [], []
    for _ in range(repeats + 1):  # the first round pins and allocates; it is not timed
        hosted, seconds = timed(device, lambda: host.offload([[r] for r in rows]))
        for part in hosted:
            part.wait()
        out.append(seconds)
        # Back into the stores they came from: the rows are the same, and no device memory is allocated.
        pairs = list(zip(hosted, rows, strict=True))
        _, seconds = timed(device, lambda pairs=pairs: [host.bring_back(p, into=[r]) for p, r in pairs])
        back.append(seconds)
        host.let_go(sum(p.nbytes for p in hosted), hosted)
        del hosted, pairs  # their pinned memory goes back to torch's host cache for the next round
    return {
        "block_mb": nbytes / blocks / 1e6,
        "device_to_host_gbs": nbytes / min(out[1:]) / 1e9,
        "host_to_device_gbs": nbytes / min(back[1:]) / 1e9,
    }


def decode_layouts(model: StageModel, *, device: torch.device, decode_depth: int) -> dict[str, float]:
    """One stream's decode tokens/s after `decode_depth` positions: 64-position blocks against one block spanning
    the context."""
    context = -(-(decode_depth + depth.WARM + depth.STEPS + 1) // BLOCK_TOKENS) * BLOCK_TOKENS
    speeds = {}
    generator = torch.Generator(device=device).manual_seed(0)
    for name, block in (("paged", BLOCK_TOKENS), ("contiguous", context)):
        pool = pool_for(model, context=context, parallel=1, device=device, block=block)
        engine = Engine(model=model, pool=pool, device=device, dtype=default_dtype(device))
        engine.warm_up()
        depth.fill(engine, slot=0, depth=decode_depth, generator=generator)
        speeds[name] = depth.decode_speed(engine, depths={0: decode_depth})
        gpu.log(f"decode at {decode_depth}, {name} ({block}-position blocks): {speeds[name]:.1f} tok/s")
        del engine, pool
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return speeds


def prefill(engine: Engine, *, slot: int, tokens: tuple[int, ...], start: int, chunk: int) -> int:
    """Positions start..len(tokens)-1 of `slot` in chunks; the token the last one samples."""
    token = -1
    for begin in range(start, len(tokens), chunk):
        part = tokens[begin : begin + chunk]
        last = begin + len(part) == len(tokens)
        step = engine.step(
            [Chunk(slot=slot, start_position=begin, length=len(part), token_ids=part, sample=last)], None
        )
        if last:
            token = step.tokens[slot].token_id
    return token


def ttft(
    model: StageModel, *, device: torch.device, tokens: int, chunk: int, rounds: int = 2
) -> dict[str, float | int | bool]:
    """Time to first token of a `tokens` prompt, recomputed against restored from the host tier; the best of
    `rounds` (the first compiles the kernels of each chunk shape)."""
    context = -(-(tokens + 2 * BLOCK_TOKENS) // BLOCK_TOKENS) * BLOCK_TOKENS
    pool = pool_for(model, context=context, parallel=2, device=device, block=BLOCK_TOKENS)
    engine = Engine(model=model, pool=pool, device=device, dtype=default_dtype(device), cuda_graphs=False)
    prompt = gpu.prompt(tokens, vocab=model.config.vocab_size, seed=7)
    saved = (tokens - 1) // BLOCK_TOKENS * BLOCK_TOKENS  # the block-aligned prefix, leaving a token to prefill
    snapshot_bytes = saved * pool.cell_bytes
    cache = PrefixCache(budget_bytes=snapshot_bytes, host=HostTier(budget_bytes=snapshot_bytes, device=device))
    best = {"recompute_s": float("inf"), "restore_s": float("inf"), "copy_s": float("inf")}
    for round_ in range(rounds):
        cache.clear()
        pool.reset(0)
        pool.reset(1)
        first, recompute_s = timed(device, lambda: prefill(engine, slot=0, tokens=prompt, start=0, chunk=chunk))
        if not cache.save(pool=pool, slot=0, generation=0, key=b"long", length=saved):
            raise RuntimeError(f"the prefix cache did not keep the {saved}-position snapshot ({snapshot_bytes} B)")
        pool.reset(0)
        # A second, one-block snapshot over the device budget sends the long one to the host tier.
        prefill(engine, slot=1, tokens=(*prompt[:BLOCK_TOKENS], 1), start=0, chunk=chunk)
        cache.save(pool=pool, slot=1, generation=0, key=b"short", length=BLOCK_TOKENS)
        pool.reset(1)
        host = cache.host_stats()
        if host is None or host.entries != 1:
            raise RuntimeError(f"the long prefix did not move to the host tier: {host}")
        gpu.sync(device)
        started = time.perf_counter()
        if not cache.restore(pool=pool, slot=1, generation=0, key=b"long", length=saved):
            raise RuntimeError("the host tier did not restore the long prefix")
        gpu.sync(device)
        copied = time.perf_counter()
        again = prefill(engine, slot=1, tokens=prompt, start=saved, chunk=chunk)
        gpu.sync(device)
        done = time.perf_counter()
        if again != first:
            raise RuntimeError(f"the restored prefix sampled token {again}, the recomputed one {first}")
        gpu.log(
            f"round {round_ + 1}: {tokens} tokens recomputed in {recompute_s:.3f} s, restored from the host tier in "
            f"{done - started:.3f} s ({copied - started:.3f} s of it the restore)"
        )
        best = {
            "recompute_s": min(best["recompute_s"], recompute_s),
            "restore_s": min(best["restore_s"], done - started),
            "copy_s": min(best["copy_s"], copied - started),
        }
    return {"tokens": tokens, **best, "snapshot_gb": snapshot_bytes / 1e9, "same_first_token": True}


def write_model(folder: Path, *, device: torch.device) -> Path:
    if device.type == "cuda":
        return write_bulk_q8_model(folder / "llama3-8b-q8.gguf", shape=LARGE_SHAPES["llama3-8b"]).path
    return write_test_model(folder / "llama.gguf", architecture="llama", block_count=4).path


def table(machine: dict[str, str], figures: dict[str, dict[str, float | int | bool]]) -> str:
    copy, decode, first = figures["copy"], figures["decode"], figures["ttft"]
    lines = [
        "machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()),
        "",
        "| figure | value |",
        "|---|---|",
        f"| block size (64 positions, every layer, q8_0) | {copy['block_mb']:.2f} MB |",
        f"| device -> host (host tier) | {copy['device_to_host_gbs']:.1f} GB/s |",
        f"| host -> device (host tier) | {copy['host_to_device_gbs']:.1f} GB/s |",
        f"| decode at {figures['sizes']['decode_depth']}, paged | {decode['paged']:.1f} tok/s |",
        f"| decode at {figures['sizes']['decode_depth']}, contiguous | {decode['contiguous']:.1f} tok/s |",
        f"| paged / contiguous | {decode['paged'] / decode['contiguous']:.3f} |",
        f"| TTFT {first['tokens']} tokens, recomputed | {first['recompute_s']:.3f} s |",
        f"| TTFT {first['tokens']} tokens, from the host tier | {first['restore_s']:.3f} s |",
        f"| of it the restore ({first['snapshot_gb']:.3f} GB from the host) | {first['copy_s']:.3f} s |",
        f"| speed-up | {float(first['recompute_s']) / float(first['restore_s']):.1f}x |",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--ttft-tokens", type=int, help="prompt length (default 131072 on a GPU, 1024 on a CPU)")
    parser.add_argument("--decode-depth", type=int, help="decode depth (default 4096 on a GPU, 256 on a CPU)")
    parser.add_argument("--prefill-chunk", type=int, help="positions a prefill step (default 8192 GPU, 256 CPU)")
    parser.add_argument("--copy-blocks", type=int, help="blocks moved per copy (default 256 GPU, 8 CPU)")
    parser.add_argument("--model", type=Path, help="a GGUF file to use instead of a generated one")
    parser.add_argument("--phase-timeout-s", type=float, default=1200.0, help="deadline of each phase")
    parser.add_argument("--out", type=Path, help="also write the figures as JSON here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device")
    on_gpu = device.type == "cuda"
    sizes = {
        "ttft_tokens": args.ttft_tokens or (131072 if on_gpu else 1024),
        "decode_depth": args.decode_depth or (4096 if on_gpu else 256),
        "prefill_chunk": args.prefill_chunk or (8192 if on_gpu else 256),
        "copy_blocks": args.copy_blocks or (256 if on_gpu else 8),
    }
    for name, value in sizes.items():
        if value < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive, not {value}")
    with tempfile.TemporaryDirectory(prefix="kv-paging-") as folder:
        with deadline("writing the model", args.phase_timeout_s):
            path = args.model or write_model(Path(folder), device=device)
        with deadline("loading the model", args.phase_timeout_s):
            model = gpu.load(path, span=(0, _layers(path)), device=device, dtype=default_dtype(device))
        gpu.log(f"model {path.name}: {len(model.layers)} layers on {device}")
        figures: dict[str, dict[str, float | int | bool]] = {"sizes": dict(sizes)}
        with deadline("block copies", args.phase_timeout_s):
            figures["copy"] = block_bandwidth(model, device=device, blocks=sizes["copy_blocks"], repeats=5)
        with deadline("decode, paged and contiguous", args.phase_timeout_s):
            figures["decode"] = dict(decode_layouts(model, device=device, decode_depth=sizes["decode_depth"]))
        with deadline("time to first token", args.phase_timeout_s):
            figures["ttft"] = ttft(model, device=device, tokens=sizes["ttft_tokens"], chunk=sizes["prefill_chunk"])
    try:
        machine = gpu.machine(device)
    except ImportError:  # gpu.machine names transformers' version; a bare stage-worker install has none
        machine = {"device": str(device), "torch": torch.__version__}
    print(table(machine, figures))
    if args.out is not None:
        args.out.write_text(json.dumps({"machine": machine, **figures}, indent=2))
    return 0


def _layers(path: Path) -> int:
    from strata.gguf import inspect_model

    return inspect_model(str(path)).block_count


if __name__ == "__main__":
    sys.exit(main())
