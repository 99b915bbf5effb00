#!/usr/bin/env bash
# Downloads, at the versions constraints.txt pins, the wheels a GPU machine without a package index needs to run
# Strata's benches, `strata serve` and `pytest tests/gpu` beside the torch, Triton and numpy it already has
# (CPython 3.12, x86-64), into DIR (default .whl). On that machine:
#   python3 -m pip install --no-index --no-deps --target /tmp/site DIR/*.whl && export PYTHONPATH=/tmp/site:core:...
# plus a dist-info for `strata` itself (the CLI reads its version), and the protos compiled here (core/strata/rpc).
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
names=(
  aiohappyeyeballs aiohttp aiohttp-retry aiosignal annotated-doc annotated-types anyio attrs certifi cffi
  charset-normalizer click cryptography durationpy fastapi frozenlist gguf grpcio grpcio-health-checking h11 httpcore
  httpx hypothesis idna iniconfig jinja2 kubernetes llguidance markupsafe multidict oauthlib opentelemetry-api
  packaging pluggy prometheus-client propcache protobuf pycparser pydantic pydantic-core pytest pytest-timeout
  python-dateutil python-multipart pyyaml requests requests-oauthlib sniffio sortedcontainers sse-starlette starlette
  tqdm typing-extensions typing-inspection tzdata urllib3 uvicorn websocket-client yarl
)
# Each name with its pin, names compared as pip normalises them (case, '_' and '.' as '-').
mapfile -t pins < <(python3 - "${names[@]}" <<'PY'
import re, sys
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
pins = {norm(line.split("==")[0]): line.strip() for line in open("constraints.txt") if "==" in line and not line.startswith("#")}
missing = [name for name in sys.argv[1:] if norm(name) not in pins]
if missing:
    sys.exit(f"gpu-wheels: not pinned in constraints.txt: {' '.join(missing)}")
print("\n".join(pins[norm(name)] for name in sys.argv[1:]))
PY
)
[[ ${#pins[@]} -eq ${#names[@]} ]] || exit 1
platforms=()
for p in manylinux_2_{34,31,28,27,24,17}_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
mkdir -p "$dest"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$dest" "${pins[@]}"
# pip may leave two builds of one version (two manylinux tags: cryptography did); an offline install refuses the pair,
# so keep one, the one of the oldest glibc (its name sorts first).
python3 - "$dest" <<'PY'
import collections, pathlib, sys
builds = collections.defaultdict(list)
for wheel in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    name, version = wheel.name.split("-")[:2]
    builds[name.lower(), version].append(wheel)
for wheels in builds.values():
    for extra in wheels[1:]:
        extra.unlink()
PY
echo "gpu-wheels: ${#pins[@]} wheels in $dest ($(du -sh "$dest" | cut -f1))"
