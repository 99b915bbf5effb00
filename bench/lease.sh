#!/usr/bin/env bash
# One GPU lease's measurements, in the tree, so a lease is spent measuring rather than writing scripts that a new
# checkout loses (the scratch scripts of earlier leases lived in the ignored .tmp/ and went with their checkouts).
#
#   here, once:       bash bench/lease.sh prepare          wheels (.whl), llama.cpp's source (.peer), protos compiled
#   each device call: bash bench/lease.sh STEP [STEP...]   carry .whl, .peer and core/strata/rpc; figures in $OUT
#
# A device call may run 10 minutes and a warm machine waits 30 s for the next call, so the steps are cut to fit one
# call each and keep their state under /tmp/strata-lease on the machine (the generated files, llama.cpp's build,
# the installed wheels): call them back to back, the setup first. BENCH_ARGS goes to the step's bench (residency's
# --files q8_0 or --skip fidelity, say, where one call cannot hold both files). Steps, in the order that closes issues soonest:
#
#   setup      install the wheels; start llama.cpp's build on the CPUs (it goes on after the call); write the
#              Llama-3-8B-shape Q8_0 file and run the tests step under SETUP_TESTS_S (default 360 s)
#   attention  bench/depth.py --kernel-only: the attention kernel's checks and its launches (ATTENTION_CONFIGS)
#   residency  bench/residency.py on the Q8_0 and Q4_K_M files, fidelity included (issue 17's table)
#   depth      bench/depth.py beside llama.cpp at every depth, with the resident window (issues 29 and 24)
#   paging     bench/kv_paging.py: the paged pool against the contiguous one, the host tier's bandwidth, a 128K prompt
#              restored from the host against recomputed (issue 24's other figures, for the same lease as depth)
#   profile    bench/decode_profile.py on the Q8_0 file and the Q4_K_M one (residency makes it): where a one-stream
#              step goes, kernel by kernel, and what the host and the gaps between kernels add (BENCH_ARGS=--ops: also
#              the op and the project's line behind each kernel; --launches: the step with the kernels launched the
#              other way beside it, dependent or plain)
#   tests      tests/gpu and the kernels' tests compiled, under TESTS_S (default 540 s) together (TESTS: other paths)
#   needle     bench/needle.py on the real Gemma 3 270M on the GPU (issue 24's recall). The file is 253 MB: split it
#              here (bench/gpu-pieces.sh split FILE .pieces), then one call a piece before this step, carrying
#              .pieces/piece-NN and .pieces/sha256 alone: bash bench/gpu-pieces.sh keep .pieces /tmp/strata-lease/pieces
#   kernels    bench/quant_matmul.py --dot8 and --sweep (the launch shapes behind the residency table)
#   normed     bench/quant_matmul.py --normed: the normed one-row Q8_0 products' launch shapes (a minute)
set -euo pipefail
cd "$(dirname "$0")/.."
STATE=${STRATA_LEASE_STATE:-/tmp/strata-lease}
OUT=${OUT:-$STATE/out}

prepare() {
  [ -x .venv/bin/python ] || { echo "lease: run make setup first (the protos and the pinned versions)" >&2; exit 1; }
  bash bench/gpu-wheels.sh .whl
  .venv/bin/python bench/llamacpp.py prepare .peer
  for ignored in .whl .peer; do
    git check-ignore -q "$ignored" || echo "/$ignored/" >> .git/info/exclude
  done
  echo "lease: carry .whl, .peer and core/strata/rpc in every device call ($(du -shc .whl .peer core/strata/rpc | tail -1 | cut -f1))"
}

environment() {
  # The device's python3 has torch and Triton; the rest comes from the carried wheels, installed once a machine.
  if [ ! -f "$STATE/site/.installed" ]; then
    mkdir -p "$STATE/site"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$STATE/site" .whl/*.whl
    # strata's own dist-info: the CLI reads its version from the installed metadata.
    version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)
    info="$STATE/site/strata-$version.dist-info"
    mkdir -p "$info"
    printf 'Metadata-Version: 2.1\nName: strata\nVersion: %s\n' "$version" > "$info/METADATA"
    printf '[console_scripts]\nstrata = strata.cli:main\n' > "$info/entry_points.txt"
    touch "$STATE/site/.installed"
  fi
  export PYTHONPATH="$STATE/site:core:operator:stage_worker:gateway:testbed:bench"
  export PYTHONUNBUFFERED=1
  mkdir -p "$OUT"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/machine.txt"
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/machine.txt"
}

setup() {
  # llama.cpp compiles (niced, in a session of its own so it outlives this call) on the CPUs while the next calls
  # measure on the GPU; the steps that run it wait for it (peer_built)
  if [ ! -f "$STATE/build-llamacpp.sh" ]; then
    mkdir -p "$STATE/llamacpp"
    printf '%s\n' "cd '$PWD'" \
      "nice -n 10 python3 -c \"import sys; sys.path.insert(0, 'bench'); from pathlib import Path; import llamacpp; print(llamacpp.build(Path('$PWD/.peer/llama-src.tar.xz'), work=Path('$STATE/llamacpp'), cuda=True))\"" \
      "echo \$? > '$STATE/llamacpp.done'" > "$STATE/build-llamacpp.sh"
    setsid nohup bash "$STATE/build-llamacpp.sh" < /dev/null > "$STATE/llamacpp-build.log" 2>&1 &
  fi
  python3 -c "
from pathlib import Path
from strata.gguf.testmodels import LARGE_SHAPES
from strata.gguf.testmodels.bulk import write_bulk_q8_model
path = Path('$STATE/strata-bench-model.gguf')
if not path.exists():
    write_bulk_q8_model(path, shape=LARGE_SHAPES['llama3-8b'])
print(path, path.stat().st_size)
"
  # the GPU tests while llama.cpp builds, under a deadline (SETUP_TESTS_S, default 360 s) so they cannot take the
  # call's measurements with them
  TESTS_S=${SETUP_TESTS_S:-360} tests
}

peer_built() {
  # the build setup started; 540 s at most, a call's time less what a bench needs after it
  local waited=0
  until [ -f "$STATE/llamacpp.done" ]; do
    [ "$waited" -lt 540 ] || { echo "lease: llama.cpp still building after ${waited}s:"; tail -5 "$STATE/llamacpp-build.log"; exit 1; }
    sleep 5
    waited=$((waited + 5))
  done
  [ "$(cat "$STATE/llamacpp.done")" = 0 ] || { echo "lease: llama.cpp did not build:"; tail -20 "$STATE/llamacpp-build.log"; exit 1; }
  cp "$STATE/llamacpp-build.log" "$OUT/llamacpp-build.log"
  echo "lease: llama.cpp built (waited ${waited}s): $(tail -1 "$STATE/llamacpp-build.log")"
}

attention() {
  # the attention kernel alone: its checks on the GPU and the launches in ATTENTION_CONFIGS (names of bench/depth.py's
  # kernel_speed, separated by ';'; empty: all of them)
  python3 bench/depth.py --kernel-only --out "$OUT" --configs "${ATTENTION_CONFIGS:-}" ${BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/attention.log" | tail -40
}

residency() {
  peer_built
  python3 bench/residency.py --dir "$STATE" --peer-work "$STATE/llamacpp" --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/residency.log" | tail -40
}

depth() {
  peer_built
  python3 bench/depth.py --model "$STATE/strata-bench-model.gguf" --peer-work "$STATE/llamacpp" --out "$OUT" \
    --resident-window 4096 ${BENCH_ARGS:-} 2>&1 | tee "$OUT/depth.log" | tail -40
}

needle() {
  [ -f "$STATE/gemma-3-270m-q4_k_m.gguf" ] || bash bench/gpu-pieces.sh join "$STATE/pieces" "$STATE/gemma-3-270m-q4_k_m.gguf"
  python3 bench/needle.py --device cuda --model "$STATE/gemma-3-270m-q4_k_m.gguf" --out "$OUT/needle.json" 2>&1 \
    | tee "$OUT/needle.log" | tail -20
}

paging() {
  python3 bench/kv_paging.py --model "$STATE/strata-bench-model.gguf" --out "$OUT/kv_paging.json" ${BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/kv_paging.log" | tail -30
}

profile() {
  for file in strata-bench-model.gguf strata-bench-model-q4_k_m.gguf; do
    if [ ! -f "$STATE/$file" ]; then
      echo "lease: no $STATE/$file (the residency step makes the Q4_K_M file)"
      continue
    fi
    python3 bench/decode_profile.py --model "$STATE/$file" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/profile-${file%.gguf}.log" \
      | tail -30
  done
}

tests() {
  # tests/gpu with the shared conftest, whose packages the wheels hold (the kernels' tests take their device there);
  # the attention kernel's checks are bench/depth.py's (the attention step)
  # shellcheck disable=SC2086 # TESTS is a list of paths
  timeout "${TESTS_S:-540}" python3 -m pytest -p no:cacheprovider -q \
    ${TESTS:-tests/gpu tests/stage_worker/test_quant_dot8.py tests/stage_worker/test_quant_matmul.py \
      tests/stage_worker/test_norms_and_gates.py tests/stage_worker/test_kv_read.py} 2>&1 \
    | tee "$OUT/tests.txt" | tail -15 \
    || echo "lease: the tests stopped (exit ${PIPESTATUS[0]}; 124: past ${TESTS_S:-540}s)"
}

kernels() {
  python3 bench/quant_matmul.py --dot8 --out "$OUT/dot8.json" 2>&1 | tee "$OUT/dot8.log" | tail -30
  python3 bench/quant_matmul.py --sweep --out "$OUT/sweep.json" 2>&1 | tee "$OUT/sweep.log" | tail -30
}

normed() {
  python3 bench/quant_matmul.py --normed --out "$OUT/normed.json" 2>&1 | tee "$OUT/normed.log" | tail -10
}

STEPS="setup attention residency depth paging profile tests needle kernels normed"
[ $# -gt 0 ] || { sed -n '2,/^set -euo/p' "$0" | grep '^#' >&2; exit 2; }
if [ "$1" = prepare ]; then
  prepare
  exit
fi
for step in "$@"; do
  [[ " $STEPS " == *" $step "* ]] || { echo "lease: unknown step $step; steps: $STEPS" >&2; exit 2; }
done
environment
for step in "$@"; do
  echo "== lease: $step ($(date -u +%H:%M:%S))"
  "$step"
done
