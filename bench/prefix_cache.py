"""Prefix cache: time to first token on a hit against a miss, and multi-turn chat throughput with the cache on and off.

    .venv/bin/python bench/prefix_cache.py [--layers 4] [--stages 2] [--system-tokens 2000] [--turns 6]

Writes a llama model of realistic width (hidden 1024, 16 heads / 8 KV heads, ffn 2816, context 8192) with the shared
test-model generator and runs two real `strata serve` process trees on loopback, `--stages` stage processes each,
f16 KV: one with the prefix cache (chunks of 256 tokens), one with `--prefix-cache-bytes 0`.
1. Time to first token: the latency of a one-token chat completion whose system prompt is about `--system-tokens`
   tokens. A miss is the first request with a new system prompt; a hit is the next request with the same system
   prompt and another question (the prefix is restored on every stage, only the rest is prefilled). Three system
   prompts, medians reported, hit and miss side by side from the same server.
2. Multi-turn chat: one conversation of `--turns` turns on that system prompt, each turn resending the whole history
   plus a new question and generating 32 tokens, timed end to end on each server.
Prints one table naming the machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch
from strata.gguf.testmodels import bench_llama, write_test_model
from strata_testbed.serve import Served, strata_serve

WORDS = [
    "pipeline",
    "stage",
    "layer",
    "token",
    "cache",
    "prefix",
    "tensor",
    "gateway",
    "lane",
    "slot",
    "model",
    "shard",
    "split",
    "restore",
]
QUESTIONS = ("What does a stage hold?", "Why split the layers?", "How long is the context?", "Who holds the lease?")
REPLY_TOKENS = 32


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    return f"{platform.node()} ({cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {platform.system()})"


def system_prompt(seed: int, words: int) -> str:
    return f"Policy {seed}. " + " ".join(WORDS[(seed * 7 + i * i) % len(WORDS)] for i in range(words))


def chat(served: Served, messages: list[dict[str, str]], *, max_tokens: int) -> tuple[float, dict[str, object]]:
    """(seconds, the response body) of one greedy chat completion. The client is made before the clock starts: making
    one costs 50 ms of CPU (its TLS context), more than a cached prompt's whole answer may take."""
    with httpx.Client(timeout=600) as client:
        started = time.perf_counter()
        response = client.post(
            f"{served.base_url}/chat/completions",
            json={"model": served.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0},
        )
        elapsed = time.perf_counter() - started
    response.raise_for_status()
    body: dict[str, object] = response.json()
    return elapsed, body


def usage(body: dict[str, object]) -> tuple[int, int]:
    """(prompt tokens, cached prompt tokens)."""
    figures = body["usage"]
    assert isinstance(figures, dict)
    return int(figures["prompt_tokens"]), int(figures["prompt_tokens_details"]["cached_tokens"])


def calibrate(served: Served, target: int) -> int:
    """Words of system prompt that make about `target` prompt tokens."""
    words = 400
    _, body = chat(served, [{"role": "system", "content": system_prompt(99, words)}], max_tokens=1)
    tokens, _ = usage(body)
    return max(1, round(words * target / tokens))


def ttft(served: Served, words: int) -> tuple[list[float], list[float], int, int]:
    """Per system prompt: one miss and one hit; returns (miss seconds, hit seconds, prompt tokens, cached tokens)."""
    misses, hits = [], []
    prompt = cached = 0
    for seed in range(3):
        system = {"role": "system", "content": system_prompt(seed, words)}
        miss, _ = chat(served, [system, {"role": "user", "content": QUESTIONS[0]}], max_tokens=1)
        hit, body = chat(served, [system, {"role": "user", "content": QUESTIONS[1]}], max_tokens=1)
        misses.append(miss)
        hits.append(hit)
        prompt, cached = usage(body)
    return misses, hits, prompt, cached


def conversation(served: Served, words: int, turns: int) -> tuple[float, int, int, int]:
    """(seconds, prompt tokens, cached tokens, completion tokens) of a `turns`-turn chat on a fresh system prompt."""
    messages = [{"role": "system", "content": system_prompt(50, words)}]
    prompt = cached = completion = 0
    started = time.perf_counter()
    for turn in range(turns):
        messages.append({"role": "user", "content": f"{QUESTIONS[turn % len(QUESTIONS)]} (turn {turn})"})
        _, body = chat(served, messages, max_tokens=REPLY_TOKENS)
        p, c = usage(body)
        prompt, cached = prompt + p, cached + c
        figures = body["usage"]
        assert isinstance(figures, dict)
        completion += int(figures["completion_tokens"])
        choices = body["choices"]
        assert isinstance(choices, list)
        messages.append({"role": "assistant", "content": choices[0]["message"]["content"]})
    return time.perf_counter() - started, prompt, cached, completion


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--turns", type=int, default=6)
    args = parser.parse_args()
    shape = bench_llama(layers=args.layers, context_length=8192)
    common = ("--stages", str(args.stages), "--parallel", "2", "--context", "8192", "--cache-type", "f16")
    with tempfile.TemporaryDirectory() as folder:
        model = write_test_model(Path(folder) / "bench.gguf", architecture="llama", shape=shape).path
        size_mb = model.stat().st_size / 1e6
        with strata_serve(str(model), *common, timeout_s=300) as on:
            words = calibrate(on, args.system_tokens)
            misses, hits, prompt, cached = ttft(on, words)
            chat_on = conversation(on, words, args.turns)
        with strata_serve(str(model), *common, "--prefix-cache-bytes", "0", timeout_s=300) as off:
            chat_off = conversation(off, words, args.turns)

    miss, hit = statistics.median(misses), statistics.median(hits)
    print(f"machine: {machine()}")
    print(
        f"model: llama, {args.layers} layers, hidden 1024, ffn 2816, 16 heads / 8 KV heads, {size_mb:.0f} MB GGUF; "
        f"strata serve, {args.stages} stage processes, f16 KV, f32 compute on CPU, prefix chunk 256\n"
    )
    print(f"time to first token, system prompt of {prompt} prompt tokens ({cached} restored on a hit), median of 3")
    print(f"{'miss s':>8} {'hit s':>8} {'speed-up':>9}")
    print(f"{miss:>8.2f} {hit:>8.2f} {miss / hit:>8.1f}x\n")
    print(f"multi-turn chat: {args.turns} turns, {REPLY_TOKENS} tokens a reply, whole history resent each turn")
    print(f"{'cache':<6} {'total s':>8} {'turns/s':>8} {'prompt tok':>11} {'cached tok':>11} {'gen tok/s':>10}")
    for name, (seconds, prompt_tokens, cached_tokens, completion) in (("on", chat_on), ("off", chat_off)):
        print(
            f"{name:<6} {seconds:>8.2f} {args.turns / seconds:>8.3f} {prompt_tokens:>11} {cached_tokens:>11} "
            f"{completion / seconds:>10.2f}"
        )
    print(f"\nthroughput with the cache on: {chat_off[0] / chat_on[0]:.1f}x the cache off")


if __name__ == "__main__":
    main()
