"""Admission under a burst, and the gateway's added latency per token, against a real `strata serve` on loopback.

    .venv/bin/python bench/gateway_admission.py [--burst 200] [--lanes 4] [--tokens 256]

1. A burst: `--burst` simultaneous chat-free completions (32 tokens each) against `--lanes` lanes with one waiting
   place per lane. Reports how many were served and refused, refusals per second (refusals / time from the burst's
   start to the last 429), and p50/p99 latency of a 429 as the client sees it. On a small machine the client's own
   200 connections share the cores with the server, so these are upper bounds on the gateway's decision time.
2. Per-token latency of one greedy decode of `--tokens` tokens: through the gateway (SSE arrivals, streaming) and
   straight to a stage worker over one raw gRPC Forward stream (the same model, one stage, one slot). The difference
   is what the gateway adds per token: HTTP, SSE framing, detokenisation and the async driver.
Prints one table naming the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from grpc import aio
from strata.gateway.local import StageProcess
from strata.gguf.testmodels import write_test_model
from strata.rpc.v1 import stage_pb2, stage_pb2_grpc
from strata.stage_worker.client import wait_loaded
from strata_testbed.serve import Served, strata_serve

PROMPT = "Once upon"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    return f"{platform.node()} ({cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, {platform.system()})"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def burst(served: Served, *, size: int) -> dict[str, float]:
    body = {"model": served.model, "prompt": PROMPT, "max_tokens": 32, "temperature": 0}
    limits = httpx.Limits(max_connections=size + 10, max_keepalive_connections=size + 10)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        await client.get(f"{served.root}/healthz")

        async def one() -> tuple[int, float]:
            sent = time.perf_counter()
            response = await client.post(f"{served.base_url}/completions", json=body)
            return response.status_code, time.perf_counter() - sent

        start = time.perf_counter()
        results = await asyncio.gather(*(one() for _ in range(size)))
    refused = [latency for status, latency in results if status == 429]
    ok = sum(status == 200 for status, _ in results)
    return {
        "ok": ok,
        "refused": len(refused),
        "refusals_per_s": len(refused) / max(refused) if refused else 0.0,
        "p50_ms": 1000 * statistics.median(refused) if refused else float("nan"),
        "p99_ms": 1000 * percentile(refused, 0.99) if refused else float("nan"),
        "wall_s": time.perf_counter() - start,
    }


def gateway_per_token(served: Served, *, tokens: int) -> tuple[float, int]:
    body = {"model": served.model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True}
    arrivals: list[float] = []
    with httpx.Client(timeout=120) as client, client.stream("POST", f"{served.base_url}/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"finish_reason":null' in line:
                arrivals.append(time.perf_counter())
    return (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1), len(arrivals)


async def _raw_decode(target: str, *, prompt: tuple[int, ...], tokens: int) -> float:
    """Seconds per decode step over one raw Forward stream: the floor any coordinator pays."""
    fence = stage_pb2.Fence(lease_uid="bench", term=1, holder="bench")
    async with aio.insecure_channel(target) as channel:
        stub = stage_pb2_grpc.StageStub(channel)
        await stub.Claim(stage_pb2.ClaimRequest(fence=fence))
        call = stub.Forward()
        step = 0

        async def forward(chunk: stage_pb2.SlotChunk) -> int:
            nonlocal step
            step += 1
            await call.write(stage_pb2.ForwardRequest(fence=fence, step_id=step, chunks=[chunk]))
            reply = await call.read()
            return int(reply.tokens[0].token_id)

        token = await forward(
            stage_pb2.SlotChunk(slot=0, start_position=0, length=len(prompt), token_ids=prompt, sample=True)
        )
        start = time.perf_counter()
        for position in range(len(prompt), len(prompt) + tokens - 1):
            token = await forward(
                stage_pb2.SlotChunk(slot=0, start_position=position, length=1, token_ids=[token], sample=True)
            )
        elapsed = time.perf_counter() - start
        await call.done_writing()
        return elapsed / (tokens - 1)


def direct_per_token(model: Path, *, tokens: int, prompt: tuple[int, ...], workdir: Path) -> float:
    env = {
        "STRATA_LAYER_START": "0",
        "STRATA_LAYER_END": "4",
        "STRATA_MODEL_URL": str(model),
        "STRATA_CONTEXT": "4096",
        "STRATA_PARALLEL": "1",
        "STRATA_CACHE_TYPE_K": "f16",
        "STRATA_CACHE_TYPE_V": "f16",
        "STRATA_LISTEN": "127.0.0.1:0",
    }
    stage = StageProcess(env=env, log_path=workdir / "direct-stage.log")
    try:
        target = f"127.0.0.1:{stage.port}"
        wait_loaded(target, timeout_s=60)
        return asyncio.run(_raw_decode(target, prompt=prompt, tokens=tokens))
    finally:
        stage.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--burst", type=int, default=200)
    parser.add_argument("--lanes", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="strata-bench-"))
    model = write_test_model(workdir / "qwen2.gguf", architecture="qwen2", block_count=4).path
    kv = ("--cache-type", "f16")  # as the direct stage below, so the difference is the gateway's alone
    lanes = ("--parallel", str(args.lanes), "--context", "4096", *kv)
    with strata_serve(str(model), *lanes) as served:
        result = asyncio.run(burst(served, size=args.burst))
    with strata_serve(str(model), "--parallel", "1", "--context", "4096", *kv) as served:
        gateway_s, streamed = gateway_per_token(served, tokens=args.tokens)
        from strata.gateway.tokenizer import GGUFTokenizer, TokenizerSpec
        from strata.gguf import read_model_header

        tokenizer = GGUFTokenizer(TokenizerSpec.from_metadata(read_model_header(str(model))[0].metadata))
        prompt = tuple(tokenizer.encode(PROMPT))
    direct_s = direct_per_token(model, tokens=streamed, prompt=prompt, workdir=workdir)
    print(f"machine: {machine()}")
    print(f"model: generated qwen2, 4 layers, hidden 128, one stage process; {args.lanes} lanes, 1 waiting per lane")
    print("| measure | value |")
    print("| --- | --- |")
    print(f"| burst of {args.burst} simultaneous requests | {result['ok']:.0f} served, {result['refused']:.0f} refused "
          f"(429) in {result['wall_s']:.2f} s |")  # fmt: skip
    print(f"| refusals per second | {result['refusals_per_s']:.0f} |")
    print(f"| 429 latency p50 / p99 | {result['p50_ms']:.1f} ms / {result['p99_ms']:.1f} ms |")
    print(f"| per token through the gateway ({streamed} tokens, SSE) | {1000 * gateway_s:.2f} ms |")
    print(f"| per token straight to the stage (raw gRPC stream) | {1000 * direct_s:.2f} ms |")
    print(f"| added by the gateway per token | {1000 * (gateway_s - direct_s):.2f} ms |")


if __name__ == "__main__":
    main()
