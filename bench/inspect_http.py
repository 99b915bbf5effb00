"""How much a header read costs over HTTP: bytes fetched vs header size vs file size, through a local Range server.

    .venv/bin/python bench/inspect_http.py

Writes each header-only large model (sparse, at the real model's full size) to a temporary folder, serves it with
the test bed's Range server, inspects it over HTTP, and prints one row per model with the machine it ran on.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from pathlib import Path

from strata.gguf import read_model_header
from strata.gguf.testmodels import LARGE_SHAPES, write_header_only_model
from strata_testbed.range_server import serve_directory


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    return f"{platform.node()} ({cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, {platform.system()})"


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        for name in LARGE_SHAPES:
            write_header_only_model(root / f"{name}.gguf", shape=name, full_size=True)
        with serve_directory(root) as server:
            for name in LARGE_SHAPES:
                started = time.perf_counter()
                header, size = read_model_header(f"{server.url}/{name}.gguf")
                elapsed = time.perf_counter() - started
                rows.append((name, header.tensor_info_end, header.bytes_fetched, header.requests, size or 0, elapsed))
    print(f"machine: {machine()}")
    print(
        f"{'model':<15} {'header B':>12} {'fetched B':>12} {'fetched/header':>15} {'requests':>9} {'file B':>16} "
        f"{'fetched/file':>13} {'seconds':>8}"
    )
    for name, header_size, fetched, requests, size, elapsed in rows:
        print(
            f"{name:<15} {header_size:>12,} {fetched:>12,} {fetched / header_size:>15.2f} {requests:>9} {size:>16,} "
            f"{fetched / size:>13.6f} {elapsed:>8.3f}"
        )


if __name__ == "__main__":
    main()
