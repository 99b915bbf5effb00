"""What a JSON-schema constraint costs: tokens/s with and without one, and the grammar's compile and mask times.

    .venv/bin/python bench/structured_outputs.py [--tokens 128] [--rounds 2] [--stages 1] [--device cpu|cuda]

1. Against a real `strata serve` on a generated model (4 layers, 16 lanes): chat completions of `--tokens` tokens at
   1 and 16 concurrent streams, each once free and once under a JSON schema whose string field cannot close within
   the limit (so the constrained reply runs as long as the free one). Aggregate tokens/s = completion tokens of all
   streams over the wall time; the constrained figure includes the gateway's mask per token and its trip in every
   step.
2. In process, on the same vocabulary: building llguidance's view of the vocabulary (once per model), compiling a
   schema the first time and from the cache, and the mask per token along a constrained reply.
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
from typing import Any

import httpx
from strata.gateway.grammar import Grammars
from strata.gateway.tokenizer import GGUFTokenizer, TokenizerSpec
from strata.gguf import read_model_header
from strata.gguf.testmodels import write_test_model
from strata_testbed.serve import Served, strata_serve

SCHEMA: dict[str, Any] = {
    "type": "object",
    # minLength keeps the string open past any --tokens asked for, so both runs write the same number of tokens.
    "properties": {"kind": {"enum": ["note", "todo"]}, "text": {"type": "string", "minLength": 4096}},
    "required": ["kind", "text"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "note", "schema": SCHEMA, "strict": True}}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    return f"{platform.node()} ({cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, {platform.system()})"


def gpu(device: str) -> str:
    if not device.startswith("cuda"):
        return ""
    import torch  # only where the stages run on a GPU: the gateway's machine needs none

    return f"; stages on {torch.cuda.get_device_name(torch.device(device))}"


async def throughput(served: Served, *, streams: int, tokens: int, constrained: bool) -> tuple[float, int]:
    """(aggregate tokens/s, completion tokens) of `streams` concurrent chat completions."""
    body: dict[str, Any] = {
        "model": served.model,
        "messages": [{"role": "user", "content": "Write a note."}],
        "max_tokens": tokens,
        "temperature": 1.0,
    }
    if constrained:
        body["response_format"] = FORMAT
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(seed: int) -> int:
            response = await client.post(f"{served.base_url}/chat/completions", json=body | {"seed": seed})
            if response.is_error:  # the gateway's words and its log, not only a status
                tail = "\n".join(served.output.text().splitlines()[-40:])
                raise RuntimeError(f"{response.status_code}: {response.text}\nstrata serve printed:\n{tail}")
            return int(response.json()["usage"]["completion_tokens"])

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(seed) for seed in range(streams)))
        elapsed = time.perf_counter() - start
    return sum(counts) / elapsed, sum(counts)


def grammar_costs(model: Path, *, tokens: int) -> dict[str, float]:
    tokenizer = GGUFTokenizer(TokenizerSpec.from_metadata(read_model_header(str(model))[0].metadata))
    grammars = Grammars(tokenizer)
    start = time.perf_counter()
    grammars.start(grammars.json_schema({"type": "object"}, param="warm-up"))  # builds the vocabulary view
    setup = time.perf_counter() - start
    start = time.perf_counter()
    grammar = grammars.json_schema(SCHEMA, param="schema")
    first = time.perf_counter() - start
    start = time.perf_counter()
    grammars.json_schema(SCHEMA, param="schema")
    cached = time.perf_counter() - start
    constraint = grammars.start(grammar)
    # A reply that keeps the string open: the mask is computed at every token, as the driver does.
    text = '{"kind":"note","text":"' + "pipeline stages pass hidden states along " * 8
    masks = []
    for token in tokenizer.encode(text, add_special=False)[:tokens]:
        start = time.perf_counter()
        constraint.mask()
        masks.append(time.perf_counter() - start)
        constraint.advance(token)
    return {
        "vocabulary view, ms": setup * 1e3,
        "schema compile, first, ms": first * 1e3,
        "schema compile, cached, ms": cached * 1e3,
        "mask per token, mean, us": statistics.mean(masks) * 1e6,
        "mask per token, max, us": max(masks) * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each case; the best is kept")
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="`strata serve --device`: where the stages run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = write_test_model(Path(folder) / "qwen2.gguf", architecture="qwen2", block_count=4).path
        rows: list[tuple[str, str]] = []
        flags = ("--stages", str(args.stages), "--parallel", "16", "--context", "4096", "--device", args.device)
        with strata_serve(str(model), *flags) as served:
            for streams in (1, 16):
                free = max(
                    asyncio.run(throughput(served, streams=streams, tokens=args.tokens, constrained=False))
                    for _ in range(args.rounds)
                )
                held = max(
                    asyncio.run(throughput(served, streams=streams, tokens=args.tokens, constrained=True))
                    for _ in range(args.rounds)
                )
                rows.append((f"tokens/s, {streams} stream(s), free", f"{free[0]:.1f} ({free[1]} tokens)"))
                rows.append((f"tokens/s, {streams} stream(s), JSON schema", f"{held[0]:.1f} ({held[1]} tokens)"))
                rows.append((f"constrained / free, {streams} stream(s)", f"{held[0] / free[0]:.2f}"))
        for name, cost in grammar_costs(model, tokens=args.tokens).items():
            rows.append((name, f"{cost:.2f}"))
    print(f"machine: {machine()}{gpu(args.device)}; {args.stages} stage(s), {args.tokens} tokens per stream")
    print("| figure | value |\n| --- | ---: |")
    for name, value in rows:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
