"""Where a stage reads its GGUF bytes: a local file, or an HTTP(S) URL with Range requests.

A stage reads the header and then only the byte ranges of its own tensors, so a stage holding a tenth of the layers
fetches about a tenth of the file. Both sources answer `read(offset, size)`; nothing else in the loader knows
which one it has.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import httpx
from strata.stage_worker.errors import ModelFileError


class ByteSource(Protocol):
    def read(self, offset: int, size: int) -> bytes: ...

    def close(self) -> None: ...


class LocalFile:
    def __init__(self, path: Path) -> None:
        self._file = path.open("rb")
        self.size = path.stat().st_size

    def read(self, offset: int, size: int) -> bytes:
        self._file.seek(offset)
        data = self._file.read(size)
        if len(data) != size:
            raise ModelFileError(f"wanted {size} bytes at offset {offset}; the file ends at {self.size}")
        return data

    def close(self) -> None:
        self._file.close()


class HttpFile:
    def __init__(self, url: str, *, timeout_s: float = 60.0) -> None:
        self.url = url
        self._client = httpx.Client(timeout=timeout_s, follow_redirects=True)

    def read(self, offset: int, size: int) -> bytes:
        headers = {"Range": f"bytes={offset}-{offset + size - 1}"}
        try:
            response = self._client.get(self.url, headers=headers)
        except httpx.HTTPError as exc:
            raise ModelFileError(f"reading {size} bytes at offset {offset} of {self.url} failed: {exc}") from exc
        if response.status_code != httpx.codes.PARTIAL_CONTENT:
            raise ModelFileError(
                f"{self.url} answered HTTP {response.status_code} to a Range request for bytes at offset {offset}; "
                "the server must support Range requests (206 Partial Content)"
            )
        if len(response.content) != size:
            raise ModelFileError(f"wanted {size} bytes at offset {offset} of {self.url}, got {len(response.content)}")
        return response.content

    def close(self) -> None:
        self._client.close()


def open_source(location: str) -> ByteSource:
    """A local path (or file:// URL) or an http(s):// URL."""
    if location.startswith(("http://", "https://")):
        return HttpFile(location)
    path = Path(location.removeprefix("file://"))
    if not path.is_file():
        raise ModelFileError(f"model file {path} does not exist")
    return LocalFile(path)
