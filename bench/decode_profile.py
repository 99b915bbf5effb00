"""Where a decode step's time goes on one GPU: the kernels of one replayed step, by name, and what the host adds.

    python bench/decode_profile.py [--model FILE] [--depth 300] [--steps 10] [--prefill N] [--launches] [--ops]
        [--out DIR]

Loads `--model` (by default bench/gpu.py's Llama-3-8B-shape file, random Q8_0 weights, written where it runs) into
the in-process engine (weights in their blocks, compiled blocks in CUDA graphs, q8_0 KV), decodes one stream after
`--depth` positions, and reports: the engine's step time and a bare graph replay's (their difference is the host's
part of a step), then the torch profiler's view of `--steps` steps: kernels a step, kernel time a step, the gaps
between kernels, and the kernels grouped by name, most time first; with `--ops`, each kernel's op and the project's
line behind it, from steps run compiled but outside graphs; with `--prefill N`, the kernels of one N-token prefill
(a first token's step); with `--launches`, the step of an engine whose kernels launch the other way (as
dependents or plainly: strata.stage_worker.kernels.dependent_launch), timed in the same run. The
table of docs/benchmarks.md's "Where a single-stream step goes" came from here.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from strata.gguf.testmodels import LARGE_SHAPES
from strata.gguf.testmodels.bulk import write_bulk_q8_model
from strata.stage_worker.engine import Chunk, Engine
from strata.stage_worker.kernels import dependent_launch
from strata.stage_worker.model import StageModel
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu  # the GPU bench's loaders and measures, shared

SHAPE = LARGE_SHAPES["llama3-8b"]
TOP = 25  # kernel names the table lists
GAP_LIMIT_US = 500.0  # a longer pause between kernels is the host between steps, not a gap inside one


def decode_once(engine: Engine, *, position: int, token: int) -> int:
    chunk = Chunk(slot=0, start_position=position, length=1, token_ids=(token,), sample=True)
    return engine.step([chunk], None).tokens[0].token_id


def warmed(engine: Engine, *, prompt: tuple[int, ...], steps: int) -> tuple[int, int]:
    """(next position, last token) after prefilling `prompt` into slot 0 and decoding `steps` steps after it (a
    graphed engine captures its graphs in them)."""
    token = gpu.engine_prefill(engine, slot=0, tokens=prompt)[0]
    position = len(prompt)
    for _ in range(steps):
        token = decode_once(engine, position=position, token=token)
        position += 1
    return position, token


def host_share(engine: Engine, *, position: int, token: int, steps: int) -> tuple[float, float, int, int]:
    """(engine step s, mean bare replay s, next position, last token): one stream, graphs already captured. The
    engine's steps are timed back to back, as a stream decodes: a step launched ahead (strata.stage_worker.
    decode_ahead) overlaps the host's part of the step before it, which a sync before each step would hide."""
    times = []
    for _ in range(5):
        gpu.sync(engine.device)
        begun = time.perf_counter()
        for _ in range(steps):
            token = decode_once(engine, position=position, token=token)
            position += 1
        gpu.sync(engine.device)
        times.append((time.perf_counter() - begun) / steps)
    graph = engine.decoder._captured[(1, 1)].graph
    gpu.sync(engine.device)
    begun = time.perf_counter()
    for _ in range(steps):
        graph.replay()
    gpu.sync(engine.device)
    return statistics.median(times), (time.perf_counter() - begun) / steps, position, token


def other_launches_step(model: StageModel, *, prompt: tuple[int, ...], dependent: bool) -> float:
    """The engine step (s, decoding ahead on, as `host_share` times it) of a fresh engine whose kernels launch as
    dependents or plainly (`dependent`): its graphs are captured under that STRATA_DEPENDENT_LAUNCH, which the
    launches read as they are captured."""
    before = os.environ.get(dependent_launch.ENVIRONMENT)
    os.environ[dependent_launch.ENVIRONMENT] = "1" if dependent else "0"
    try:
        engine = gpu.engine_for(model, device=torch.device("cuda:0"), dtype=torch.bfloat16, graphs=True)
        position, token = warmed(engine, prompt=prompt, steps=8)
        step, *_ = host_share(engine, position=position, token=token, steps=50)
    finally:
        if before is None:
            del os.environ[dependent_launch.ENVIRONMENT]
        else:
            os.environ[dependent_launch.ENVIRONMENT] = before
    return step


def kernel_table(engine: Engine, *, position: int, token: int, steps: int) -> dict[str, object]:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            token = decode_once(engine, position=position, token=token)
            position += 1
        gpu.sync(engine.device)
    return by_kernel(prof, steps=steps)


def prefill_table(engine: Engine, *, tokens: tuple[int, ...]) -> dict[str, object]:
    """The kernel table of one prefill of `tokens` (a first token's step, as bench/residency.py times it), after one
    unprofiled prefill of the same length (its compiles and captures)."""
    gpu.engine_prefill(engine, slot=0, tokens=tokens)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        gpu.engine_prefill(engine, slot=0, tokens=tokens)
        gpu.sync(engine.device)
    return by_kernel(prof, steps=1)


def by_kernel(prof: profile, *, steps: int) -> dict[str, object]:
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start
    )
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for event in kernels:
        by_name[event.name][0] += 1
        by_name[event.name][1] += event.device_time
    gaps = [b.time_range.start - a.time_range.end for a, b in itertools.pairwise(kernels)]
    return {
        "kernels_per_step": len(kernels) / steps,
        "kernel_ms_per_step": sum(t for _, t in by_name.values()) / steps / 1e3,
        "gap_ms_per_step": sum(g for g in gaps if g < GAP_LIMIT_US) / steps / 1e3,
        "by_name": sorted(
            ((name, count / steps, us / steps) for name, (count, us) in by_name.items()), key=lambda row: -row[2]
        ),
    }


def op_table(engine: Engine, *, position: int, token: int, steps: int) -> list[tuple[str, str, str, int, float]]:
    """(kernel, the op that launched it, the project's innermost line under that op, launches a step, us a step),
    most time first: `engine` runs its steps compiled but not from graphs (a graph's replay has no host ops to name),
    profiled with Python stacks. What a replayed step's kernel table cannot say: which line of the model a torch
    kernel or a generated one comes from."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        for _ in range(steps):
            token = decode_once(engine, position=position, token=token)
            position += 1
        gpu.sync(engine.device)
    rows: dict[tuple[str, str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CPU or not event.kernels:
            continue
        line = _project_line(event)
        for kernel in event.kernels:
            row = rows[(kernel.name, event.name, line)]
            row[0] += 1
            row[1] += kernel.duration
    table = [(kernel, op, line, round(count / steps), us / steps) for (kernel, op, line), (count, us) in rows.items()]
    return sorted(table, key=lambda row: -row[4])


def _project_line(event: FunctionEvent) -> str:
    """The innermost frame of the project's code above an op: from its stack where the profiler keeps one, else from
    the Python function events it nests in (how torch 2.15 records with_stack)."""
    frames = list(event.stack)
    parent = event.cpu_parent
    while parent is not None:
        frames.append(parent.name)
        parent = parent.cpu_parent
    return next((frame for frame in frames if "strata/" in frame and ".py(" in frame), "")


def render_ops(rows: list[tuple[str, str, str, int, float]]) -> str:
    lines = [
        "kernels by the op and the project's line that launched them (steps compiled, not replayed from graphs):",
        "",
        "| us a step | launches a step | kernel | op | line |",
        "| ---: | ---: | --- | --- | --- |",
    ]
    for kernel, op, line, count, us in rows[:TOP]:
        lines.append(f"| {us:.1f} | {count} | `{kernel[:60]}` | `{op[:50]}` | `{line[-90:]}` |")
    return "\n".join(lines) + "\n"


def render(r: dict[str, object], *, depth: int) -> str:
    table, machine = r["kernels"], r["machine"]
    assert isinstance(table, dict)
    assert isinstance(machine, dict)
    lines = [
        "machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()),
        f"model: {r['model_file']} (llama3-8b shape, random weights kept in their blocks), bf16 compute, q8_0 KV; one "
        f"stream at depth {depth}",
        "",
        f"engine step {r['step_ms']:.3f} ms (median of 5 runs of back-to-back steps); bare graph replay "
        f"{r['replay_ms']:.3f} ms (the host's part: {r['step_ms'] - r['replay_ms']:.3f} ms)",  # type: ignore[operator]
        f"decoding ahead {'on' if r['ahead'] else 'off (not possible here)'}; with it off the step takes "
        f"{r['step_behind_ms']:.3f} ms",
        f"kernels a step {table['kernels_per_step']:.0f}; kernel time {table['kernel_ms_per_step']:.3f} ms; gaps "
        f"between them {table['gap_ms_per_step']:.3f} ms (steps profiled with decoding ahead off)",
        "",
        "| us a step | launches a step | kernel |",
        "| ---: | ---: | --- |",
    ]
    for name, count, us in table["by_name"][:TOP]:
        lines.append(f"| {us:.1f} | {count:.0f} | `{name[:100]}` |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path(tempfile.gettempdir()) / "strata-bench-model.gguf")
    parser.add_argument("--depth", type=int, default=300)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--prefill", type=int, default=0, help="also the kernels of one prefill of this many tokens (0: none)"
    )
    parser.add_argument(
        "--launches", action="store_true", help="also time the step of an engine whose kernels launch the other way "
        "(as dependents, or plainly: strata.stage_worker.kernels.dependent_launch), side by side"
    )  # fmt: skip
    parser.add_argument(
        "--ops", action="store_true", help="also name the op and the project's line behind each kernel (a second "
        "engine, its steps compiled but not in graphs)"
    )  # fmt: skip
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/decode_profile.py profiles a GPU's decode step")
    device = torch.device("cuda:0")
    if not args.model.exists():
        write_bulk_q8_model(args.model, shape=SHAPE)
    model = gpu.load(args.model, span=(0, SHAPE.block_count), device=device, dtype=torch.bfloat16)
    engine = gpu.engine_for(model, device=device, dtype=torch.bfloat16, graphs=True)
    prompt = gpu.prompt(args.depth, vocab=model.config.vocab_size, seed=1)
    position, token = warmed(engine, prompt=prompt, steps=8)  # captures and warms up
    step, replay, position, token = host_share(engine, position=position, token=token, steps=50)
    ahead, engine.decodes_ahead = engine.decodes_ahead, False
    step_behind, _, position, token = host_share(engine, position=position, token=token, steps=50)
    # Profiled with decoding ahead still off: on, the last profiled step launches one more, whose kernels the profile
    # caught (an H100 profile of 2026-12-07 counted 35 launches a step of a 32-layer model's once-a-layer kernels).
    kernels = kernel_table(engine, position=position, token=token, steps=args.steps)
    engine.decodes_ahead = ahead
    results: dict[str, object] = {
        "machine": gpu.machine(device),
        "model_file": args.model.name,
        "step_ms": step * 1e3,
        "step_behind_ms": step_behind * 1e3,
        "ahead": ahead,
        "replay_ms": replay * 1e3,
        "kernels": kernels,
    }
    table = render(results, depth=args.depth)
    print(table)
    if args.prefill:
        started = time.perf_counter()
        prefill = prefill_table(engine, tokens=gpu.prompt(args.prefill, vocab=model.config.vocab_size, seed=2))
        lines = [
            f"one prefill of {args.prefill} tokens (profiled; {time.perf_counter() - started:.1f} s with its warm-up): "
            f"{prefill['kernels_per_step']:.0f} kernels, kernel time {prefill['kernel_ms_per_step']:.1f} ms, gaps "
            f"{prefill['gap_ms_per_step']:.1f} ms",
            "",
            "| us | launches | kernel |",
            "| ---: | ---: | --- |",
        ]
        by_name = prefill["by_name"]
        assert isinstance(by_name, list)
        lines += [f"| {us:.1f} | {count:.0f} | `{name[:100]}` |" for name, count, us in by_name[:TOP]]
        results["prefill"] = prefill
        print("\n".join(lines) + "\n")
        table += "\n" + "\n".join(lines) + "\n"
    if args.launches:
        with dependent_launch.captured_step():  # as the engine's graphs were captured
            dependent = dependent_launch.enabled(device)
        other = other_launches_step(model, prompt=prompt, dependent=not dependent)
        steps = {dependent: step, not dependent: other}
        compared = (
            f"kernels launched as dependents: engine step {steps[True] * 1e3:.3f} ms; plainly: "
            f"{steps[False] * 1e3:.3f} ms (plain / dependent {steps[False] / steps[True]:.3f}x), in this run\n"
        )
        results["dependent_step_ms"], results["plain_step_ms"] = steps[True] * 1e3, steps[False] * 1e3
        print(compared)
        table += "\n" + compared
    if args.ops:
        del engine  # its pool and graphs: the second engine's steps run from the compiled blocks alone
        eager = gpu.engine_for(model, device=device, dtype=torch.bfloat16, graphs=False, compiled=True)
        position, token = warmed(eager, prompt=prompt, steps=4)
        ops = render_ops(op_table(eager, position=position, token=token, steps=3))
        print(ops)
        table += "\n" + ops
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "decode_profile.md").write_text(table)


if __name__ == "__main__":
    main()
