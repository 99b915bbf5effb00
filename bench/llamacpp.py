"""llama.cpp as the peer on the GPU machine: built from source, its own benchmarks run, their figures parsed.

    python bench/llamacpp.py prepare DIR                   here, with PyPI: write DIR/llama-src.tar.xz (a few MB)
    python bench/llamacpp.py run DIR MODEL [--depths ...]  on the GPU machine: build, run, print the figures as JSON

Why this exists: Strata's decode and prefill figures mean little alone; the question a reader asks is "how does it
compare with llama.cpp on the same GPU and the same GGUF file?". The GPU machine reaches no network, so the source
travels with the working tree: `prepare` takes the llama.cpp tree vendored in the `llama-cpp-python` sdist (a
pinned, reproducible version that PyPI serves through pip, no git checkout), keeps what a CUDA and a CPU build of
`llama-bench`, `llama-batched-bench` and `llama-quantize` need, and packs it small. `build` compiles those three
tools with CMake and Ninja (CUDA for sm_90a, or the CPU alone), and the measuring functions run them with the flags
the earlier side-by-side figures used (every layer offloaded, flash attention on) and return numbers, not tables:

- `decode_at_depth`: single-sequence decode tokens/s with a KV cache already `depth` tokens deep (llama-bench `-d`);
- `prompt_speed`: prompt-processing tokens/s per prompt length (time to first token ~ length / speed);
- `batched`: aggregate decode and prefill tokens/s with 1, 4, 16... parallel sequences (llama-batched-bench);
- `quantize`: a file requantised to another type (llama-quantize), e.g. the Q4_K_M of a Q8_0 file.

Every subprocess is bounded by a timeout; a failed build or run raises with the tail of what the tool printed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any

VERSION = "0.3.36"  # llama-cpp-python, whose sdist vendors llama.cpp's source
SDIST_ROOT = f"llama_cpp_python-{VERSION}/vendor/llama.cpp"
TARBALL = "llama-src.tar.xz"
TARGETS = ("llama-bench", "llama-batched-bench", "llama-quantize")
CUDA_ARCH = "90a"  # H100 / H200
DEFAULT_NVCC = "/usr/local/cuda/bin/nvcc"

# What a build of the three tools configures: the root CMake project, ggml, libllama, common, the tools/ tree (its
# CMakeLists adds every tool, so each tool's sources must exist even though only two are built) and vendor/.
KEEP_TOP = frozenset(
    {"CMakeLists.txt", "LICENSE", "cmake", "common", "ggml", "include", "licenses", "src", "tools", "vendor"}
)
# Inside those, what no CPU or CUDA build of the tools reads: other backends, other CPU architectures, the server,
# its web UI and CLI (LLAMA_BUILD_SERVER=OFF), Metal tuning, RPC (GGML_RPC=OFF), and test media.
UNBUILT_BACKENDS = (
    "blas", "cann", "et", "hexagon", "hip", "metal", "musa", "opencl", "openvino", "rpc", "sycl", "virtgpu", "vulkan",
    "webgpu", "zdnn", "zendnn",
)  # fmt: skip
OTHER_CPU_ARCHS = ("loongarch", "powerpc", "riscv", "s390", "wasm")  # x86 and arm (GH200) stay
DROP = tuple(
    PurePosixPath(p)
    for p in (
        *(f"ggml/src/ggml-{b}" for b in UNBUILT_BACKENDS),
        *(f"ggml/src/ggml-cpu/arch/{a}" for a in OTHER_CPU_ARCHS),
        "ggml/src/ggml-cpu/spacemit",
        "ggml/src/ggml-cpu/kleidiai",
        "tools/server",
        "tools/ui",
        "tools/cli",
        "tools/tuning",
        "tools/rpc",
        "tools/mtmd/tests",
        "tools/mtmd/legacy-models",
    )
)
DROP_SUFFIXES = frozenset({".md", ".png", ".jpg", ".jpeg", ".gif", ".mp3", ".mp4", ".wav", ".ipynb", ".py"})

PIP_TIMEOUT_S = 1800.0  # pip builds the sdist's metadata, which installs its build requirements
CONFIGURE_TIMEOUT_S = 600.0
BUILD_TIMEOUT_S = 3600.0
LOG_TAIL_CHARS = 4000


class PeerError(RuntimeError):
    """llama.cpp did not build or a benchmark did not run; the message ends with the tail of its output."""


def _tail(text: str, chars: int = LOG_TAIL_CHARS) -> str:
    return text[-chars:]


def _keep(rel: PurePosixPath) -> bool:
    """Whether a path of the vendored tree (relative to its root) goes into the tarball."""
    if not rel.parts:
        return False
    if rel.parts[0] not in KEEP_TOP:
        return False
    if rel.suffix.lower() in DROP_SUFFIXES:
        return False
    return not any(rel == d or rel.is_relative_to(d) for d in DROP)


def prepare(dest: Path) -> Path:
    """Download the llama-cpp-python sdist (with PyPI access) and write dest/llama-src.tar.xz, the pruned source."""
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / TARBALL
    with tempfile.TemporaryDirectory(prefix="llamacpp-sdist-") as tmp:
        argv = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:"]
        argv += ["-d", tmp, f"llama-cpp-python=={VERSION}"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
        if done.returncode != 0:
            raise PeerError(f"pip download failed (exit {done.returncode}):\n{_tail(done.stdout + done.stderr)}")
        sdists = sorted(Path(tmp).glob(f"llama_cpp_python-{VERSION}.tar.gz"))
        if not sdists:
            raise PeerError(f"pip download wrote no llama_cpp_python-{VERSION}.tar.gz into {tmp}")
        partial = out.with_suffix(".partial")
        kept = 0
        with tarfile.open(sdists[0], "r|gz") as src, tarfile.open(partial, "w:xz", preset=9) as packed:
            for member in src:
                name = PurePosixPath(member.name)
                if not name.is_relative_to(SDIST_ROOT) or not (member.isfile() or member.issym()):
                    continue
                rel = name.relative_to(SDIST_ROOT)
                if not _keep(rel):
                    continue
                # A fresh header: the sdist's long names sit in pax headers, which would override a renamed member's
                info = tarfile.TarInfo(str(rel))
                info.type, info.mode, info.mtime = member.type, member.mode, int(member.mtime)
                info.size, info.linkname = member.size, member.linkname
                packed.addfile(info, src.extractfile(member) if member.isfile() else None)
                kept += 1
        if kept == 0:
            partial.unlink()
            raise PeerError(f"no files under {SDIST_ROOT} in {sdists[0].name}")
        partial.replace(out)
    return out


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _cmake_args(*, cuda: bool) -> list[str]:
    args = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DLLAMA_CURL=OFF",  # deprecated (and ignored) in this llama.cpp; kept so older trees build the same way
        "-DLLAMA_OPENSSL=OFF",  # no HTTPS model downloads: the tools read local files
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_SERVER=OFF",
        "-DLLAMA_BUILD_APP=OFF",  # the unified `llama` binary links the server, which is not built
        "-DBUILD_SHARED_LIBS=OFF",  # self-contained binaries: the bin dir runs wherever it is copied
    ]
    if not cuda:
        return [*args, "-DGGML_CUDA=OFF"]
    args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={CUDA_ARCH}"]
    # CUDA images often leave /usr/local/cuda/bin off PATH, where CMake would not find nvcc
    nvcc = shutil.which("nvcc") or (DEFAULT_NVCC if Path(DEFAULT_NVCC).exists() else None)
    return [*args, f"-DCMAKE_CUDA_COMPILER={nvcc}"] if nvcc else args


def _logged(argv: list[str], *, log: Path, timeout_s: float, what: str) -> None:
    """Run a build step with its output appended to `log`; raise PeerError with the log's tail when it fails."""
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(argv)}\n")
        f.flush()
        try:
            rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s, check=False).returncode
        except subprocess.TimeoutExpired:
            rc = None
    if rc != 0:
        why = f"timed out after {timeout_s:g} s" if rc is None else f"failed (exit {rc})"
        raise PeerError(f"llama.cpp {what} {why}; {log}:\n{_tail(log.read_text(errors='replace'))}")


def build(
    source_tar: Path, *, work: Path, cuda: bool, jobs: int | None = None, timeout_s: float = BUILD_TIMEOUT_S
) -> Path:
    """Extract `source_tar` under `work` and build the TARGETS; return their bin dir.

    A build already there from the same tarball and flags is reused as it is. `jobs` defaults to every core.
    """
    if shutil.which("cmake") is None:
        raise PeerError("cmake is not on PATH")
    variant = "cuda" if cuda else "cpu"
    src = work / "llama.cpp"
    out = work / f"build-{variant}"
    bin_dir = out / "bin"
    configure = _cmake_args(cuda=cuda)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []  # else CMake's default (Makefiles)
    source_sha = _sha256(source_tar)
    stamp_text = json.dumps({"source": source_sha, "configure": configure + generator}, sort_keys=True)
    stamp = out / "strata-build.json"
    if stamp.exists() and stamp.read_text() == stamp_text and all((bin_dir / t).is_file() for t in TARGETS):
        return bin_dir

    work.mkdir(parents=True, exist_ok=True)
    src_stamp = src / ".strata-source-sha256"
    if not (src_stamp.exists() and src_stamp.read_text() == source_sha):
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)  # a build dir of other sources would keep stale objects
        with tarfile.open(source_tar, "r:xz") as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(src, filter="data")
            else:  # Python before 3.11.4 has no extraction filters; the tarball is the one `prepare` wrote
                tar.extractall(src)  # noqa: S202
        src_stamp.write_text(source_sha)
    stamp.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    log = work / f"build-{variant}.log"
    log.write_text("")
    _logged(
        ["cmake", "-S", str(src), "-B", str(out), *generator, *configure],
        log=log, timeout_s=CONFIGURE_TIMEOUT_S, what="configure",
    )  # fmt: skip
    _logged(
        ["cmake", "--build", str(out), "-j", str(jobs or os.cpu_count() or 1), "--target", *TARGETS],
        log=log, timeout_s=timeout_s, what="build",
    )  # fmt: skip
    missing = [t for t in TARGETS if not (bin_dir / t).is_file()]
    if missing:
        raise PeerError(f"the build left no {', '.join(missing)} in {bin_dir}; {log}:\n{_tail(log.read_text())}")
    stamp.write_text(stamp_text)
    return bin_dir


def build_in_background(source_tar: Path, *, work: Path) -> subprocess.Popen[str]:
    """Start `build` (CUDA) in a niced child process, so llama.cpp compiles on the CPUs while Strata measures on the
    GPU; `built` waits for it."""
    script = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from pathlib import Path; import llamacpp; "
        f"print(llamacpp.build(Path({str(source_tar)!r}), work=Path({str(work)!r}), cuda=True))"
    )
    return subprocess.Popen(
        ["nice", "-n", "19", sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def built(child: subprocess.Popen[str], *, timeout_s: float = BUILD_TIMEOUT_S) -> Path:
    """The bin dir of a build started by `build_in_background`, once it is done."""
    output, _ = child.communicate(timeout=timeout_s)
    if child.returncode != 0:
        raise PeerError(f"building llama.cpp failed:\n{_tail(output)}")
    return Path(output.strip().splitlines()[-1])


def _run(argv: list[str], *, timeout_s: float) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise PeerError(f"{Path(argv[0]).name} timed out after {timeout_s:g} s:\n{_tail(err)}") from e
    if done.returncode != 0:
        output = done.stderr + done.stdout
        # llama-bench names a bad argument on its first line, then prints its whole usage
        errors = "".join(f"{line}\n" for line in output.splitlines() if "error" in line.lower())
        raise PeerError(
            f"{Path(argv[0]).name} failed (exit {done.returncode}): {' '.join(argv)}\n"
            f"{_tail(errors, 1000)}--- output tail:\n{_tail(output)}"
        )
    return done


def _llama_bench(
    bin_dir: Path, model: Path, *, extra: list[str], cache_type: str, repetitions: int, timeout_s: float
) -> list[dict[str, Any]]:
    """llama-bench's JSON records (one per test); the fields used are n_prompt, n_gen, n_depth and avg_ts."""
    argv = [str(bin_dir / "llama-bench"), "-m", str(model), "-ngl", "99", "-fa", "1", *extra]
    argv += ["-ctk", cache_type, "-ctv", cache_type, "-r", str(repetitions), "-o", "json"]
    done = _run(argv, timeout_s=timeout_s)
    try:
        records = json.loads(done.stdout)
    except json.JSONDecodeError as e:
        raise PeerError(f"llama-bench printed no JSON ({e}):\n{_tail(done.stdout)}\n{_tail(done.stderr)}") from e
    if not isinstance(records, list):
        raise PeerError(f"llama-bench printed {type(records).__name__}, not a list of tests")
    return records


def decode_at_depth(
    bin_dir: Path,
    model: Path,
    *,
    depths: list[int],
    cache_type: str,
    tokens: int = 64,
    repetitions: int = 2,
    timeout_s: float,
) -> dict[int, float]:
    """Single-sequence decode tokens/s (llama-bench's tg`tokens`, mean of `repetitions`) with the KV cache already
    `depth` tokens deep, for each depth. `cache_type` is the K and V cache type (f16, bf16, q8_0, q4_0...)."""
    records = _llama_bench(
        bin_dir, model, extra=["-p", "0", "-n", str(tokens), "-d", ",".join(map(str, depths))],
        cache_type=cache_type, repetitions=repetitions, timeout_s=timeout_s,
    )  # fmt: skip
    speeds = {int(r["n_depth"]): float(r["avg_ts"]) for r in records if r["n_prompt"] == 0 and r["n_gen"] == tokens}
    return _all_of(speeds, depths, what="depth")


def prompt_speed(
    bin_dir: Path, model: Path, *, lengths: list[int], cache_type: str, repetitions: int = 2, timeout_s: float
) -> dict[int, float]:
    """Prompt-processing tokens/s (llama-bench's pp`length`) for each prompt length, from an empty cache; time to
    first token is about length / speed."""
    records = _llama_bench(
        bin_dir, model, extra=["-p", ",".join(map(str, lengths)), "-n", "0"],
        cache_type=cache_type, repetitions=repetitions, timeout_s=timeout_s,
    )  # fmt: skip
    speeds = {int(r["n_prompt"]): float(r["avg_ts"]) for r in records if r["n_gen"] == 0 and r["n_depth"] == 0}
    return _all_of(speeds, lengths, what="prompt length")


def _all_of(found: dict[int, float], wanted: list[int], *, what: str) -> dict[int, float]:
    missing = [w for w in wanted if w not in found]
    if missing:
        raise PeerError(f"llama-bench reported no test for {what} {missing} (got {sorted(found)})")
    return {w: found[w] for w in wanted}


BATCHED_ATTEMPTS = 3
# llama-batched-bench's JSONL keys -> the column names of its markdown table
BATCHED_FIELDS = {
    "n_kv": "N_KV",
    "t_pp": "T_PP",
    "speed_pp": "S_PP",
    "t_tg": "T_TG",
    "speed_tg": "S_TG",
    "t": "T",
    "speed": "S",
}


def batched(
    bin_dir: Path,
    model: Path,
    *,
    prompt: int,
    generate: int,
    parallel: list[int],
    cache_type: str,
    context: int,
    timeout_s: float,
) -> dict[int, dict[str, float]]:
    """Aggregate figures with `npl` sequences decoding together, each with its own `prompt`-token prompt, for each
    npl in `parallel`: S_TG (decode tokens/s, all sequences together), S_PP (prefill tokens/s), S (both), the times
    T_PP, T_TG and T in seconds, and N_KV (cache cells used).

    The cache is not unified: each sequence gets context / max(parallel) cells, which must hold prompt + generate.
    """
    per_sequence = context // max(parallel)
    if prompt + generate > per_sequence:
        raise ValueError(
            f"context {context} over {max(parallel)} sequences leaves {per_sequence} cells each, "
            f"fewer than prompt + generate = {prompt + generate}"
        )
    argv = [str(bin_dir / "llama-batched-bench"), "-m", str(model), "-ngl", "99", "-fa", "1", "-c", str(context)]
    argv += ["-b", "2048", "-ub", "512", "-npp", str(prompt), "-ntg", str(generate)]
    argv += ["-npl", ",".join(map(str, parallel)), "-ctk", cache_type, "-ctv", cache_type]
    argv += ["--output-format", "jsonl"]
    # The tool prints through llama.cpp's asynchronous logger, whose thread this version leaks and does not flush at
    # exit (llama.cpp issue 22142): the last records are now and then lost. A run that misses some npl is repeated
    # whole, so every npl is still measured with the same sequence count (hence the same cache split).
    found: dict[int, dict[str, float]] = {}
    for _ in range(BATCHED_ATTEMPTS):
        done = _run(argv, timeout_s=timeout_s)
        for line in done.stdout.splitlines():
            line = line.strip()
            if line.startswith("{") and '"speed_tg"' in line:
                record = json.loads(line)
                pl = int(record["pl"])
                found.setdefault(pl, {column: float(record[key]) for key, column in BATCHED_FIELDS.items()})
        missing = [n for n in parallel if n not in found]
        if not missing:
            return {n: found[n] for n in parallel}
    raise PeerError(
        f"llama-batched-bench reported nothing for npl {missing} in {BATCHED_ATTEMPTS} runs:\n"
        f"{_tail(done.stdout)}\n{_tail(done.stderr)}"
    )


def quantize(bin_dir: Path, source: Path, dest: Path, *, kind: str, timeout_s: float) -> Path:
    """Write `dest`, `source` requantised to `kind` (Q4_K_M, Q5_K_M, ...) by llama-quantize, as people make files."""
    _run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(source), str(dest), kind], timeout_s=timeout_s)
    return dest


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="write DIR/llama-src.tar.xz (needs PyPI)")
    prep.add_argument("dir", type=Path)
    run = commands.add_parser("run", help="build from DIR/llama-src.tar.xz and benchmark MODEL; prints JSON")
    run.add_argument("dir", type=Path)
    run.add_argument("model", type=Path)
    run.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "strata-llamacpp")
    run.add_argument("--cpu", action="store_true", help="build without CUDA")
    run.add_argument("--jobs", type=int, default=None)
    run.add_argument("--cache-type", default="f16", help="K and V cache type: f16, bf16, q8_0, q4_0...")
    run.add_argument("--depths", type=_ints, default=[0, 4096, 16384], help="comma list (default: 0,4096,16384)")
    run.add_argument("--tokens", type=int, default=64, help="decode tokens per depth test")
    run.add_argument("--repetitions", type=int, default=2)
    run.add_argument("--lengths", type=_ints, default=[512, 4096], help="prompt lengths (default: 512,4096)")
    run.add_argument("--prompt", type=int, default=300, help="batched: prompt tokens per sequence")
    run.add_argument("--generate", type=int, default=128, help="batched: tokens generated per sequence")
    run.add_argument("--parallel", type=_ints, default=[1, 4, 16], help="batched: sequences (default: 1,4,16)")
    run.add_argument("--context", type=int, default=16384, help="batched: total context (default: 16384)")
    run.add_argument("--timeout", type=float, default=600.0, help="seconds per benchmark run")
    args = parser.parse_args()

    if args.command == "prepare":
        path = prepare(args.dir)
        print(json.dumps({"tarball": str(path), "bytes": path.stat().st_size}))
        return
    variant = "CPU" if args.cpu else "CUDA"
    print(f"building llama.cpp ({variant}) under {args.work}, unless built there already", file=sys.stderr)
    bin_dir = build(args.dir / TARBALL, work=args.work, cuda=not args.cpu, jobs=args.jobs)
    print(f"running llama-bench and llama-batched-bench from {bin_dir} on {args.model}", file=sys.stderr)
    ct, timeout = args.cache_type, args.timeout
    result = {
        "model": str(args.model),
        "bin_dir": str(bin_dir),
        "cache_type": ct,
        "decode_at_depth": decode_at_depth(
            bin_dir, args.model, depths=args.depths, cache_type=ct, tokens=args.tokens,
            repetitions=args.repetitions, timeout_s=timeout,
        ),
        "prompt_speed": prompt_speed(
            bin_dir, args.model, lengths=args.lengths, cache_type=ct, repetitions=args.repetitions, timeout_s=timeout
        ),
        "batched": batched(
            bin_dir, args.model, prompt=args.prompt, generate=args.generate, parallel=args.parallel, cache_type=ct,
            context=args.context, timeout_s=timeout,
        ),
    }  # fmt: skip
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
