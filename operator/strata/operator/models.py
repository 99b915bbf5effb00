"""Model descriptions for the reconciler, read once per file version.

Reconciles repeat every few seconds; the GGUF header only changes when the file does. The cache key is the URL
plus what identifies its content: the ETag (or Last-Modified) of a remote file, the size and mtime of a local one.
"""

from __future__ import annotations

import threading
from pathlib import Path
from urllib.parse import urlparse

import httpx
from strata.gguf import GGUFError, ModelInfo, inspect_model
from strata.gguf.sources import resolve_hf

_HEAD_TIMEOUT_SECONDS = 10.0


class ModelUnreadable(Exception):
    """The model's header could not be read now (server down, file missing, malformed header)."""


def _version(url: str, token: str | None) -> str:
    if url.startswith("file://"):
        stat = Path(urlparse(url).path).stat()
        return f"{stat.st_size}:{stat.st_mtime_ns}"
    target = resolve_hf(url) if url.startswith("hf://") else url
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = httpx.head(target, headers=headers, follow_redirects=True, timeout=_HEAD_TIMEOUT_SECONDS)
    response.raise_for_status()
    return response.headers.get("etag") or response.headers.get("last-modified") or ""


class ModelCache:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: dict[tuple[str, str], ModelInfo] = {}

    def inspect(self, url: str, *, token: str | None = None) -> ModelInfo:
        try:
            key = (url, _version(url, token))
            with self._lock:
                cached = self._cache.get(key)
            if cached is not None:
                return cached
            model = inspect_model(url, token=token)
        except (GGUFError, httpx.HTTPError, OSError) as e:
            raise ModelUnreadable(f"cannot read the GGUF header of {url}: {e}") from e
        with self._lock:
            self._cache[key] = model
        return model
