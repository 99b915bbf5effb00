"""Model sources that cannot be read, one per cause, for the tests of what the operator says about each.

`serve_refusals` answers fixed paths with fixed failures (a 404, a 401 whatever the token, Hugging Face's refusal of
a gated repository, a 503); `write_bad_headers` writes files that are not GGUF, end inside their header, or claim a
count no model has. With a closed port, a name that does not resolve, TLS to a plain HTTP port and a server that
ignores Range (strata_testbed.range_server), they cover every cause of an unreadable model.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

GATED_PATH = "/org/gated/resolve/main/model.gguf"  # what hf://org/gated/model.gguf resolves to
REFUSALS: Mapping[str, tuple[int, Mapping[str, str]]] = {
    "/missing.gguf": (404, {}),
    "/private.gguf": (401, {}),
    "/org/private/resolve/main/model.gguf": (401, {}),  # hf://org/private/model.gguf: no token is the right one
    "/busy.gguf": (503, {}),
    GATED_PATH: (403, {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to model org/gated is restricted."}),
}


def _handler() -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # keep test output quiet
            return

        def _refuse(self) -> None:
            code, headers = REFUSALS.get(self.path, (404, {}))
            self.send_response(code)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = _refuse
        do_HEAD = _refuse

    return Handler


@contextmanager
def serve_refusals() -> Iterator[str]:
    """The base URL (http://127.0.0.1:PORT) of a server answering REFUSALS, for the duration of the block."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler())
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def write_bad_headers(folder: Path, *, whole: Path) -> dict[str, Path]:
    """Files that fail to read as GGUF, by cause: `not-gguf`, `truncated` (the first 100 bytes of `whole`, a valid
    model) and `hostile` (a header that claims 2^60 tensors)."""
    files = {
        "not-gguf": folder / "not-gguf.gguf",
        "truncated": folder / "truncated.gguf",
        "hostile": folder / "hostile.gguf",
    }
    files["not-gguf"].write_bytes(b"<html>this is a login page, not a model</html>\n" * 8)
    files["truncated"].write_bytes(whole.read_bytes()[:100])
    files["hostile"].write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2**60, 0))
    return files
