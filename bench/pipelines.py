"""Several pipelines behind one gateway: aggregate throughput of 2 against 1, and prefix-cache hits by routing policy.

    .venv/bin/python bench/pipelines.py [--layers 4] [--lanes 4] [--tokens 48] [--rounds 3] [--chats 12] [--turns 4]
                                        [--devices cpu | cuda:0,cuda:1]

1. Throughput. A llama of realistic width (bench_llama, `--layers` layers) served by 1, then 2 pipelines of one
   stage each; every stage is its own `strata stage-worker` process on loopback, the gateway (the real app and its
   drivers, strata.gateway.pipelines) runs in this process. Each pipeline has `--lanes` lanes, and the load keeps
   every lane busy: `--rounds` waves of as many completions as there are lanes, `--tokens` tokens each (the end of
   text is biased away, so each runs its full length). Tokens per second is tokens generated over the wall time.
   `--devices`: pipeline i runs on the i-th device of the list (round the list), so on a machine of two GPUs each
   pipeline has a GPU of its own.
2. Prefix-cache hits. The small test model, with pipelines of one in-process stage each and a prefix chunk of 16
   tokens: `--chats` conversations of `--turns` turns, each with its own system prompt, turns sent one at a time in
   an order shuffled within each round (seeded), so neither policy gets a lucky rhythm. A chat's first turn cannot
   hit (nothing is cached yet); the rate is over the later turns: hits / (hits + misses) as the gateway counts them.
   Prefix-affine routing (the default) against round robin, over 2 and 4 pipelines.
Prints one table naming the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import platform
import random
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import torch
from strata.gateway.local import StageProcess
from strata.gateway.pipelines import PipelineEntry
from strata.gateway.routing import Policy
from strata.gateway.server import build
from strata.gateway.serving import Serving
from strata.gateway.settings import GatewaySettings
from strata.gguf import read_model_header
from strata.gguf.testmodels import bench_llama, write_test_model
from strata_testbed.pipelines import local_pipeline

CONTEXT = 4096
CHUNK = 16


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    gpus = ""
    if torch.cuda.is_available():
        gpus = f", {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"{platform.node()} ({cpu}, {os.cpu_count()} cores{gpus}, torch {torch.__version__}, {platform.system()})"


def settings(model: Path, *, lanes: int, context: int, prefix_chunk: int) -> GatewaySettings:
    return GatewaySettings(
        model_url=str(model),
        model_name="bench",
        first_stage="unused:0",
        context=context,
        parallel=lanes,
        prefix_cache_chunk=prefix_chunk,
        queue_per_lane=4,
        max_wait_seconds=600,
    )


@contextlib.asynccontextmanager
async def gateway(
    model: Path, addresses: list[str], *, lanes: int, context: int, prefix_chunk: int, policy: Policy = Policy.PREFIX
) -> AsyncIterator[tuple[httpx.AsyncClient, Serving]]:
    """The gateway app driving one pipeline per address, its lifespan run here; a client on it."""
    header, _size = read_model_header(str(model))
    app, serving = build(settings(model, lanes=lanes, context=context, prefix_chunk=prefix_chunk), header=header)
    serving.pipelines.policy = policy
    entries = [
        PipelineEntry(index=i, generation=0, first_stage=address, parallel=lanes, context=context)
        for i, address in enumerate(addresses)
    ]
    await serving.pipelines.start(entries)
    try:
        deadline = time.monotonic() + 300
        while not all(d.ready for d in serving.pipelines.drivers.values()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the pipelines did not get ready: {serving.pipelines.not_ready_reason}")
            await asyncio.sleep(0.1)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=600) as http:
            yield http, serving
    finally:
        await serving.pipelines.close()


@contextlib.contextmanager
def stage_processes(model: Path, count: int, *, lanes: int, folder: Path, devices: list[str]) -> Iterator[list[str]]:
    """`count` single-stage pipelines as worker processes, pipeline i on devices[i % len(devices)]; their
    addresses."""
    layers = read_model_header(str(model))[0].metadata["llama.block_count"]
    stages: list[StageProcess] = []
    try:
        for index in range(count):
            env = {
                "STRATA_STAGE_INDEX": "0",
                "STRATA_LAYER_START": "0",
                "STRATA_LAYER_END": str(layers),
                "STRATA_MODEL_URL": str(model),
                "STRATA_CONTEXT": str(CONTEXT),
                "STRATA_PARALLEL": str(lanes),
                "STRATA_CACHE_TYPE_K": "f16",
                "STRATA_CACHE_TYPE_V": "f16",
                "STRATA_NEXT_STAGE": "",
                "STRATA_LISTEN": "127.0.0.1:0",
                "STRATA_DEVICE": devices[index % len(devices)],
                "STRATA_PREFIX_CACHE_BYTES": "0",
            }
            stages.append(StageProcess(env=env, log_path=folder / f"pipeline-{count}-{index}.log"))
        yield [f"127.0.0.1:{stage.port}" for stage in stages]
    finally:
        for stage in stages:
            stage.stop()


async def throughput(model: Path, addresses: list[str], *, lanes: int, tokens: int, rounds: int) -> float:
    async with gateway(model, addresses, lanes=lanes, context=CONTEXT, prefix_chunk=0) as (http, serving):
        no_end = {str(t): -100 for t in serving.tokenizer.stop_ids}

        async def one(n: int) -> int:
            body = {
                "model": "bench",
                "prompt": f"Request {n}: tell a story",
                "max_tokens": tokens,
                "logit_bias": no_end,
            }
            response = await http.post("/v1/completions", json=body)
            response.raise_for_status()
            return int(response.json()["usage"]["completion_tokens"])

        await asyncio.gather(*(one(-n - 1) for n in range(len(addresses) * lanes)))  # warm every lane's path
        started = time.monotonic()
        generated = 0
        for wave in range(rounds):
            counts = await asyncio.gather(*(one(wave * 1000 + n) for n in range(len(addresses) * lanes)))
            generated += sum(counts)
        return generated / (time.monotonic() - started)


def hit_counts(serving: Serving, pipelines: int) -> tuple[float, float]:
    registry = serving.metrics.registry

    def total(name: str) -> float:
        return sum(
            registry.get_sample_value(f"strata_gateway_prefix_cache_{name}_total", {"pipeline": str(i)}) or 0.0
            for i in range(pipelines)
        )

    return total("hits"), total("misses")


async def hit_rate(model: Path, addresses: list[str], *, policy: Policy, chats: int, turns: int) -> float:
    async with gateway(model, addresses, lanes=2, context=1024, prefix_chunk=CHUNK, policy=policy) as (http, serving):
        histories = [
            [{"role": "system", "content": f"You are helper {c}, who answers questions about topic {c} briefly."}]
            for c in range(chats)
        ]
        order = random.Random(26)  # noqa: S311 (a reproducible order, not a secret)
        before = (0.0, 0.0)
        for turn in range(turns):
            if turn == 1:
                before = hit_counts(serving, len(addresses))  # first turns: nothing to hit yet
            for chat in order.sample(range(chats), chats):
                messages = [*histories[chat], {"role": "user", "content": f"Question {turn} about it?"}]
                body = {"model": "bench", "messages": messages, "max_tokens": 4, "temperature": 0}
                response = await http.post("/v1/chat/completions", json=body)
                response.raise_for_status()
                answer = response.json()["choices"][0]["message"]["content"] or "ok"
                histories[chat] = [*messages, {"role": "assistant", "content": answer}]
        hits, misses = hit_counts(serving, len(addresses))
        return (hits - before[0]) / max(1.0, (hits - before[0]) + (misses - before[1]))


async def measure(args: argparse.Namespace) -> tuple[dict[int, float], dict[tuple[int, Policy], float]]:
    """Both parts on one event loop (gRPC's asyncio poller outlives a loop that asyncio.run closes)."""
    rates: dict[int, float] = {}
    hits: dict[tuple[int, Policy], float] = {}
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        wide = write_test_model(
            folder / "wide.gguf", architecture="llama", shape=bench_llama(layers=args.layers, context_length=CONTEXT)
        ).path
        for count in (1, 2):
            with stage_processes(wide, count, lanes=args.lanes, folder=folder, devices=args.devices) as addresses:
                rates[count] = await throughput(
                    wide, addresses, lanes=args.lanes, tokens=args.tokens, rounds=args.rounds
                )
            print(f"  {count} pipeline(s): {rates[count]:.1f} tokens/s", flush=True)
        small = write_test_model(folder / "small.gguf", architecture="qwen2", block_count=2).path
        for count in (2, 4):
            with contextlib.ExitStack() as stack:
                sets = [
                    stack.enter_context(local_pipeline(small, [(0, 2)], context=1024, prefix_cache_bytes=64 << 20))
                    for _ in range(count)
                ]
                addresses = [f"127.0.0.1:{s[0].port}" for s in sets]
                # Each run's gateway starts with empty prefix indexes: it restores only what it saved itself.
                for policy in (Policy.PREFIX, Policy.ROUND_ROBIN):
                    hits[count, policy] = await hit_rate(
                        small, addresses, policy=policy, chats=args.chats, turns=args.turns
                    )
                    print(f"  {count} pipelines, {policy}: {hits[count, policy]:.0%} hits", flush=True)
    return rates, hits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lanes", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chats", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--devices", type=lambda text: text.split(","), default=["cpu"], help="comma-separated")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # each gateway's drivers say they step down when it closes
    print(f"machine: {machine()}", flush=True)
    rates, hits = asyncio.run(measure(args))
    print()
    print(f"| Pipelines behind one gateway ({machine()}; stages on {', '.join(args.devices)}) | Figure |")
    print("|---|---|")
    print(f"| 1 pipeline, {args.lanes} lanes, {args.tokens}-token completions | {rates[1]:.1f} tokens/s |")
    print(f"| 2 pipelines, {args.lanes} lanes each | {rates[2]:.1f} tokens/s ({rates[2] / rates[1]:.2f}x) |")
    for count in (2, 4):
        for policy in (Policy.PREFIX, Policy.ROUND_ROBIN):
            label = "prefix-affine" if policy is Policy.PREFIX else "round robin"
            print(
                f"| prefix-cache hits, turns 2-{args.turns} of {args.chats} chats, {count} pipelines, {label} | "
                f"{hits[count, policy]:.0%} |"
            )


if __name__ == "__main__":
    main()
