"""GGUF weights kept quantised on the GPU: Strata against llama.cpp on the same Q8_0 and Q4_K_M files, one lease.

    python bench/residency.py [--peer .peer/llama-src.tar.xz] [--out DIR] [--files q8_0,q4_k_m]
                              [--skip served,fidelity,peer]

Writes bench/gpu.py's Llama-3-8B-shape file with random Q8_0 weights, builds llama.cpp from the source carried in
the tree (bench/llamacpp.py; niced, on the CPUs, while Strata measures the Q8_0 file on the GPU) and makes the Q4_K_M
file from the Q8_0 one with its `llama-quantize --allow-requantize`, as people make theirs. Then, for each file:

- weights on the GPU: the bytes `torch.cuda.memory_allocated` grows by while a whole-model stage loads, against the
  file's tensor bytes;
- Strata in process (compiled blocks in CUDA graphs, q8_0 KV): decode tokens/s with 1, 4 and 16 streams (300-token
  prompts, 128 greedy steps), and time to first token for a 4,096-token prompt;
- Strata served: one `strata stage-worker` process over loopback gRPC, the same figures;
- fidelity: prompt logits against HF transformers in f32 on the same dequantised weights (bench/gpu.py's check);
- llama.cpp (CUDA, every layer offloaded, flash attention, q8_0 KV): `llama-bench -n 128` and `-p 4096`, and
  `llama-batched-bench -npp 300 -ntg 128 -npl 4,16`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from strata.gguf import read_header
from strata.gguf.sources import open_source
from strata.gguf.testmodels import LARGE_SHAPES
from strata.gguf.testmodels.bulk import write_bulk_q8_model
from strata_testbed.hf_reference import hf_from_stage

sys.path.insert(0, str(Path(__file__).parent))
import gpu
import llamacpp

SHAPE = LARGE_SHAPES["llama3-8b"]
SLOTS = gpu.SLOTS
TTFT = 4096
FILES = ("q8_0", "q4_k_m")
PARTS = ("served", "fidelity", "peer")


def log(message: str) -> None:
    print(f"[residency {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def tensor_bytes(path: Path) -> int:
    source = open_source(str(path))
    try:
        return sum(t.nbytes for t in read_header(source).tensors)
    finally:
        source.close()


def strata_figures(path: Path, *, device: torch.device, skip: set[str]) -> dict[str, object]:
    figures: dict[str, object] = {"file_tensor_bytes": tensor_bytes(path)}
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    model = gpu.load(path, span=(0, SHAPE.block_count), device=device, dtype=torch.bfloat16)
    figures["gpu_weight_bytes"] = torch.cuda.memory_allocated(device) - before
    vocab = model.config.vocab_size
    figures["weights_per_file"] = int(figures["gpu_weight_bytes"]) / int(figures["file_tensor_bytes"])  # type: ignore[call-overload]
    log(f"{path.name}: {figures['weights_per_file']:.3f}x the file's tensor bytes on the GPU")
    engine = gpu.engine_for(model, device=device, dtype=torch.bfloat16, graphs=True)
    if "fidelity" not in skip:
        figures["fidelity"] = gpu.fidelity(path, engine, hf_from_stage(model), device=device)
        log(f"{path.name} fidelity: {figures['fidelity']}")
        torch.cuda.empty_cache()
    for slots in SLOTS:
        figures[f"decode_{slots}"], _ = gpu.engine_decode(engine, slots=slots, steps=gpu.DECODE_STEPS)
        log(f"{path.name} strata {slots} streams: {figures[f'decode_{slots}']:.1f} tok/s")
    figures[f"ttft_{TTFT}"] = statistics.median(
        gpu.engine_prefill(engine, slot=0, tokens=gpu.prompt(TTFT, vocab=vocab, seed=100 + r))[1] for r in range(3)
    )
    del engine, model
    torch.cuda.empty_cache()
    if "served" not in skip:
        figures["served"] = gpu.served(path, spans=[(0, SHAPE.block_count)], devices=["cuda:0"], vocab=vocab)
        log(f"{path.name} served: {figures['served']}")
    return figures


def peer_figures(bin_dir: Path, path: Path) -> dict[str, float]:
    tg = llamacpp.decode_at_depth(bin_dir, path, depths=[0], cache_type="q8_0", tokens=gpu.DECODE_STEPS, timeout_s=300)
    pp = llamacpp.prompt_speed(bin_dir, path, lengths=[TTFT], cache_type="q8_0", timeout_s=300)
    batched = llamacpp.batched(
        bin_dir, path, prompt=gpu.DECODE_PROMPT, generate=gpu.DECODE_STEPS, parallel=[4, 16], cache_type="q8_0",
        context=16 * (gpu.DECODE_PROMPT + gpu.DECODE_STEPS) + 256, timeout_s=300,
    )  # fmt: skip
    return {
        "decode_1": tg[0],
        f"ttft_{TTFT}": TTFT / pp[TTFT],
        "decode_4": batched[4]["S_TG"],
        "decode_16": batched[16]["S_TG"],
    }


def render(r: dict[str, object]) -> str:
    machine = r["machine"]
    assert isinstance(machine, dict)
    lines = [
        "machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()),
        f"model: {SHAPE.name} shape; Q8_0 with random weights, Q4_K_M made from it by llama-quantize; bf16 compute, "
        "q8_0 KV on both sides; copy bandwidth "
        f"{float(r['bandwidth']) / 1e12:.2f} TB/s",  # type: ignore[arg-type]
        "",
        "| file | figure | Strata in process | Strata served, 1 stage | llama.cpp | Strata / llama.cpp |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for name in FILES:
        ours, theirs = r.get(name), r.get(f"llamacpp_{name}", {})
        if not isinstance(ours, dict) or not isinstance(theirs, dict):
            continue
        served = ours.get("served", {})
        assert isinstance(served, dict)
        lines.append(f"| {name} | weights on the GPU / file tensor bytes | {ours['weights_per_file']:.3f} | | | |")
        for key, label in [*((f"decode_{s}", f"decode tokens/s, {s} stream(s)") for s in SLOTS), (f"ttft_{TTFT}", "")]:
            scale, fmt = (1e3, ".0f") if key.startswith("ttft") else (1.0, ".1f")
            label = label or f"time to first token, {TTFT} tokens, ms"
            a, b, c = ours.get(key), served.get(key), theirs.get(key)
            ratio = "" if a is None or c is None else f"{(c / a if key.startswith('ttft') else a / c):.2f}x"
            cells = [format(v * scale, fmt) if isinstance(v, float) else "-" for v in (a, b, c)]
            lines.append(f"| {name} | {label} | {' | '.join(cells)} | {ratio} |")
        for chunk in gpu.GATEWAY_CHUNKS:  # served only: the prompt in the gateway's steps of `chunk` tokens
            seconds, theirs_s = served.get(f"ttft_{TTFT}_chunks_{chunk}"), theirs.get(f"ttft_{TTFT}")
            if isinstance(seconds, float):
                ratio = f"{theirs_s / seconds:.2f}x" if isinstance(theirs_s, float) else ""
                lines.append(
                    f"| {name} | time to first token, {TTFT} tokens in steps of {chunk}, ms | | "
                    f"{seconds * 1e3:.0f} | | {ratio} |"
                )
        fidelity = ours.get("fidelity")
        if isinstance(fidelity, dict):
            verdict = "PASS" if fidelity["passed"] else "FAIL"
            lines.append(
                f"| {name} | fidelity vs HF f32 (logits rel. L2; tolerance {fidelity['tolerance']:.4f}) | "
                f"{fidelity['strata_bf16_vs_hf_f32']:.4f} ({fidelity['decode_agree']} picks) {verdict} | | | |"
            )
    lines.append(
        "\nratios: Strata / llama.cpp for speeds, llama.cpp / Strata for time to first token (over 1 = faster)"
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--peer", type=Path, default=Path(".peer/llama-src.tar.xz"))
    parser.add_argument("--peer-work", type=Path, default=Path(tempfile.gettempdir()) / "strata-llamacpp")
    parser.add_argument("--skip", default="", help=f"comma-separated parts to leave out: {', '.join(PARTS)}")
    parser.add_argument("--files", default=",".join(FILES), help=f"which files Strata and llama.cpp run: {FILES}")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    skip = {s for s in args.skip.split(",") if s}
    if unknown := skip - set(PARTS):
        sys.exit(f"--skip: unknown parts {sorted(unknown)}; known: {', '.join(PARTS)}")
    if not torch.cuda.is_available():
        sys.exit(
            "bench/residency.py measures a GPU; tests/stage_worker/test_quant_matmul.py checks the kernels on CPUs"
        )
    device = torch.device("cuda:0")
    files = [f for f in args.files.split(",") if f]
    if unknown := set(files) - set(FILES):
        sys.exit(f"--files: unknown files {sorted(unknown)}; known: {', '.join(FILES)}")
    peer_build = None
    if "peer" not in skip or "q4_k_m" in files:
        if not args.peer.exists():
            sys.exit(f"no llama.cpp source at {args.peer}: python bench/llamacpp.py prepare .peer")
        peer_build = llamacpp.build_in_background(args.peer, work=args.peer_work)
    results: dict[str, object] = {"machine": gpu.machine(device), "bandwidth": gpu.copy_bandwidth(device)}
    paths = {"q8_0": args.dir / "strata-bench-model.gguf", "q4_k_m": args.dir / "strata-bench-model-q4_k_m.gguf"}
    if not paths["q8_0"].exists():
        write_bulk_q8_model(paths["q8_0"], shape=SHAPE)
    bin_dir = None
    for name in files:
        if not paths[name].exists():  # the Q4_K_M file is llama-quantize's
            bin_dir = bin_dir or llamacpp.built(peer_build)
            llamacpp.quantize(bin_dir, paths["q8_0"], paths[name], kind="Q4_K_M", timeout_s=600)
        results[name] = strata_figures(paths[name], device=device, skip=skip)
    if "peer" not in skip:
        bin_dir = bin_dir or llamacpp.built(peer_build)
        for name in files:
            results[f"llamacpp_{name}"] = peer_figures(bin_dir, paths[name])
            log(f"llama.cpp {name}: {results[f'llamacpp_{name}']}")
    table = render(results)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "residency.json").write_text(json.dumps(results, indent=1, default=str))
        (args.out / "residency.md").write_text(table)


if __name__ == "__main__":
    main()
