"""The project's Triton kernels compiled for a GPU on a machine without one: what a launch's loop costs in instructions.

    python bench/sass.py [--case NAME ...] [--warps N] [--dump DIR]

A session without a device can still weigh a kernel change by what the compiler makes of it: Triton compiles for
any target offline (its wheel ships ptxas and nvdisasm), so each case here compiles one launch of a project kernel
for sm_90a with the arguments' types and divisibility as the JIT sees them on the device, and counts the SASS of
its innermost loop: instructions, FFMA/HFMA2, byte permutes, shared-memory traffic, barriers, spills. Counts are
evidence, not timings (a lease times; bench/depth.py --kernel-only for attention).

Use the device's Triton: another version lays the same kernel out differently (Triton 3.9 put shared-memory
conversions into the 4-row fused product that 3.6 does not make). The device has Triton 3.6.0, so:

    python3.11 -m venv /tmp/tri36 && /tmp/tri36/bin/pip install triton==3.6.0
    PYTHONPATH=/tmp/tri36/lib/python3.11/site-packages:core:stage_worker .venv/bin/python bench/sass.py

The cases are named launches of the decode step at depth (Llama-3-8B heads: 32 query heads over 8 KV heads of
128 values, bf16 q, the pool's 64-position pages). Add a case to weigh another launch.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import triton
from strata.stage_worker.kernels import paged_attention_triton as attention
from triton.backends.compiler import GPUTarget

TARGET = GPUTarget("cuda", 90, 32)  # sm_90a: the H100 and H200
DEVICE_TRITON = "3.6.0"


@dataclass(frozen=True)
class Case:
    name: str
    kernel: triton.JITFunction
    types: dict[str, str]  # every runtime argument's type as the JIT names it (*bf16, i32, fp32)
    constexprs: dict[str, object]
    divisible: frozenset[str]  # arguments the JIT sees divisible by 16 (pointers are aligned: all of them)
    warps: int
    stages: int = 2
    equal_to_one: frozenset[str] = field(default_factory=frozenset)


def attention_decode(
    *,
    cache: str,
    block_n: int,
    warps: int,
    int8_scores: bool = False,
    cells_ahead: bool = False,
    stages: int = 2,
    packed_int8: bool = False,
) -> Case:
    """One stream's decode step (16 rows: the GQA group of 4 padded, over 4 positions' tile rule) over a q8_0 or
    f16 pool, as paged_attention_triton.paged_attention launches it."""
    q8 = cache == "q8_0"
    kv = "*i8" if q8 else "*fp16"
    pointers = {"q_ptr": "*bf16", "k_ptr": kv, "ks_ptr": "*fp16", "v_ptr": kv, "vs_ptr": "*fp16",
                "table_ptr": "*i32", "slots_ptr": "*i32", "q_starts_ptr": "*i32", "q_lens_ptr": "*i32",
                "kv_lens_ptr": "*i32", "o_part_ptr": "*fp32", "lse_part_ptr": "*fp32"}  # fmt: skip
    ints = ["window", "stride_qn", "stride_qh", "stride_kc", "stride_ksc", "stride_vc", "stride_vsc"]
    ints += ["stride_table", "stride_on", "stride_oh", "stride_os", "stride_ln", "stride_lh"]
    ints += ["n_rep", "head_dim", "q_tiles"]
    types = {**pointers, "sm_scale": "fp32", "softcap": "fp32", **dict.fromkeys(ints, "i32")}
    # Values of a 128K-position pool: strides of 4,096 (q rows), 128 (heads), 1,024 (a cell's row), 32 (its scales)
    # and 2,048 (a table row) are multiples of 16, as are the window and the head's width; n_rep (4) is not, and the
    # splits' strides and q_tiles are never specialised (the kernel's do_not_specialize).
    divisible = frozenset([*pointers, "window", "stride_qn", "stride_qh", "stride_kc", "stride_ksc", "stride_vc",
                           "stride_vsc", "stride_table", "head_dim"])  # fmt: skip
    constexprs: dict[str, object] = {"K_Q8": q8, "V_Q8": q8, "PAGE": 64, "BLOCK_T": 4, "REP": 4, "BLOCK_D": 128}
    constexprs |= {"BLOCK_N": block_n, "MIN_SPLIT": block_n, "F32_DOT": False, "BLOCKED_SCALES": True}
    constexprs |= {"SOFTCAP": False, "DOT_F16": True, "INT8_SCORES": int8_scores}
    constexprs |= {"CELLS_AHEAD": cells_ahead, "PACKED_INT8": packed_int8, "PDL": True}  # a dependent launch
    return Case(
        name=f"attention decode, {cache} KV, {block_n} positions a tile, {warps} warp(s), {stages} stage(s)"
        + (", int8 scores" if int8_scores else "")
        + (", cells a tile ahead" if cells_ahead else "")
        + (", int8 converted 4 a register" if packed_int8 else ""),
        kernel=attention._attend_split,
        types=types,
        constexprs=constexprs,
        divisible=divisible if q8 else divisible - {"ks_ptr", "vs_ptr", "stride_ksc", "stride_vsc"},
        warps=warps,
        stages=stages,
    )


CASES: dict[str, Callable[[], Case]] = {
    "attention-q8-lone": lambda: attention_decode(cache="q8_0", block_n=32, warps=1, stages=1),
    "attention-q8-lone-cells-ahead": lambda: attention_decode(
        cache="q8_0", block_n=32, warps=1, stages=1, cells_ahead=True
    ),
    "attention-q8-lone-packed": lambda: attention_decode(cache="q8_0", block_n=32, warps=1, stages=1, packed_int8=True),
    "attention-q8-batch": lambda: attention_decode(cache="q8_0", block_n=64, warps=2),
    "attention-f16-lone": lambda: attention_decode(cache="f16", block_n=32, warps=1, stages=1),
    "attention-q8-lone-int8": lambda: attention_decode(cache="q8_0", block_n=32, warps=1, int8_scores=True),
    "attention-q8-batch-int8": lambda: attention_decode(cache="q8_0", block_n=64, warps=2, int8_scores=True),
}


def compile_case(case: Case) -> triton.compiler.CompiledKernel:
    names = case.kernel.arg_names
    signature = {name: case.types.get(name, "constexpr") for name in names}
    if missing := [n for n in names if n not in case.types and n not in case.constexprs]:
        raise SystemExit(f"{case.name}: no type or value for {missing}")
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in case.divisible}
    source = triton.compiler.ASTSource(fn=case.kernel, signature=signature, constexprs=case.constexprs, attrs=attrs)
    return triton.compile(source, target=TARGET, options={"num_warps": case.warps, "num_stages": case.stages})


_LABEL = re.compile(r"^(\w+):$")
_BRANCH = re.compile(r"\bBRA\s+(\w+);")


def instructions(lines: list[str]) -> list[str]:
    """The instructions among lines of Triton's SASS listing: a scheduling field, a tab, the instruction."""
    return [line.split("\t", 1)[1] for line in lines if "\t" in line and line.rstrip().endswith(";")]


def innermost_loop(sass: str) -> list[str]:
    """The instructions of the longest backward branch's body that holds no other backward branch: the K/V tile loop
    of the attention kernel (its prologue and epilogue are outside)."""
    lines = sass.splitlines()
    labels: dict[str, int] = {}
    loops: list[tuple[int, int]] = []
    for index, line in enumerate(lines):
        if match := _LABEL.match(line.strip()):
            labels[match.group(1)] = index
        elif (match := _BRANCH.search(line)) and match.group(1) in labels:
            loops.append((labels[match.group(1)], index))
    inner = [(a, b) for a, b in loops if not any(a < c and d < b for c, d in loops)]
    if not inner:
        return []
    start, end = max(inner, key=lambda span: span[1] - span[0])
    return instructions(lines[start : end + 1])


def opcode(instruction: str) -> str:
    """The opcode without its modifiers or predicate: `@!P1 BRA LBB0;` -> BRA, `HMMA.16816.F32 ...` -> HMMA."""
    words = instruction.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0].rstrip(";") if words else ""


def resources(cubin: bytes) -> dict[str, int]:
    """Registers and stack (spills) a thread, from the cubin: without a driver the compiled kernel cannot say."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run([str(tool), "-res-usage", file.name], capture_output=True, text=True, check=True).stdout
    return {key: int(value) for key, value in re.findall(r"\b(REG|STACK|SHARED):(\d+)", usage)}


def summary(case: Case, kernel: triton.compiler.CompiledKernel) -> dict[str, object]:
    loop = innermost_loop(kernel.asm["sass"])
    ops = Counter(opcode(line) for line in loop)
    used = resources(kernel.asm["cubin"])
    return {
        "case": case.name,
        "registers": used["REG"],
        "stack": used["STACK"],
        "loop instructions": len(loop),
        "FFMA+FMUL+FADD": ops["FFMA"] + ops["FMUL"] + ops["FADD"],
        "HFMA2+HMUL2+HADD2": ops["HFMA2"] + ops["HMUL2"] + ops["HADD2"],
        "PRMT": ops["PRMT"],
        "LDG": ops["LDG"] + ops["LDGSTS"],
        "LDL+STL": ops["LDL"] + ops["STL"],
        "LDS+STS": ops["LDS"] + ops["STS"] + ops["LDSM"],
        "BAR": ops["BAR"],
        "MMA": ops["HMMA"] + ops["IMMA"] + ops["HGMMA"],
        "MUFU": ops["MUFU"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=sorted(CASES), help="default: every case")
    parser.add_argument("--dump", type=Path, help="write each case's SASS here")
    args = parser.parse_args()
    if triton.__version__ != DEVICE_TRITON:
        print(
            f"sass: Triton {triton.__version__}, not the device's {DEVICE_TRITON}: its layouts may differ",
            file=sys.stderr,
        )
    rows = []
    for name in args.case or sorted(CASES):
        case = CASES[name]()
        kernel = compile_case(case)
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            (args.dump / f"{name}.sass").write_text(kernel.asm["sass"])
        rows.append(summary(case, kernel))
    columns = list(rows[0])
    print(f"Triton {triton.__version__}, {TARGET.backend} sm_{TARGET.arch}; the innermost loop's SASS, one thread")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in columns) + " |")


if __name__ == "__main__":
    main()
