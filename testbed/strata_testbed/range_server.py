"""A local HTTP file server with byte-range support, for testing and benchmarking header reads over HTTP.

Python's http.server ignores Range, which is exactly the server Strata must refuse; this one honours single
`bytes=a-b` ranges (206 with Content-Range, 416 past the end) unless started with `ranges=False`, and answers
HEAD with the size and an ETag. It records every
request's headers and the body bytes it sent, so tests can check what a client fetched and which credentials it sent.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_RANGE = re.compile(r"bytes=(\d+)-(\d*)")


@dataclass
class ServedLog:
    requests: list[dict[str, str]] = field(default_factory=list)
    bytes_sent: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True, kw_only=True)
class RangeServer:
    url: str  # http://127.0.0.1:PORT
    log: ServedLog


def _handler(root: Path, *, ranges: bool, log: ServedLog) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # keep test output quiet
            return

        def _file(self) -> Path | None:
            with log.lock:
                log.requests.append(
                    {"method": self.command, "path": self.path, **{k.lower(): v for k, v in self.headers.items()}}
                )
            path = (root / self.path.lstrip("/")).resolve()
            if not path.is_relative_to(root.resolve()) or not path.is_file():
                self.send_error(404)
                return None
            return path

        def do_HEAD(self) -> None:
            """Size and validator only, as a model server answers the operator's cache check."""
            path = self._file()
            if path is None:
                return
            stat = path.stat()
            self.send_response(200)
            self.send_header("Content-Length", str(stat.st_size))
            self.send_header("ETag", f'"{stat.st_size:x}-{stat.st_mtime_ns:x}"')
            if ranges:
                self.send_header("Accept-Ranges", "bytes")
            self.end_headers()

        def do_GET(self) -> None:
            path = self._file()
            if path is None:
                return
            size = path.stat().st_size
            match = _RANGE.fullmatch(self.headers.get("Range", "")) if ranges else None
            start, end = 0, size - 1
            if match is not None:
                start = int(match[1])
                end = min(int(match[2]) if match[2] else size - 1, size - 1)
                if start >= size:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
            self.send_response(206 if match is not None else 200)
            if match is not None:
                self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
            self.send_header("Content-Length", str(end - start + 1))
            self.end_headers()
            with path.open("rb") as file:
                file.seek(start)
                remaining = end - start + 1
                while remaining > 0:
                    chunk = file.read(min(remaining, 1 << 20))
                    try:
                        self.wfile.write(chunk)
                    except (BrokenPipeError, ConnectionResetError):
                        return  # the client stopped reading, as it should when it gets 200
                    with log.lock:
                        log.bytes_sent += len(chunk)
                    remaining -= len(chunk)

    return Handler


@contextmanager
def serve_directory(root: Path, *, ranges: bool = True) -> Iterator[RangeServer]:
    """Serve `root` on a free loopback port in a background thread for the duration of the block."""
    log = ServedLog()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(root, ranges=ranges, log=log))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield RangeServer(url=f"http://127.0.0.1:{server.server_address[1]}", log=log)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
