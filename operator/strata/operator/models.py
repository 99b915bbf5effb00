"""Model descriptions for the reconciler, read once per file version, and the reason when one cannot be read.

Reconciles repeat every few seconds; the GGUF header only changes when the file does. The cache key is the URL
plus what identifies its content: the ETag (or Last-Modified) of a remote file, the size and mtime of a local one.
A header that cannot be read is a ModelUnreadable carrying the Planned condition's reason for its cause; the typed
errors of strata.gguf map to those reasons here, once.
"""

from __future__ import annotations

import threading
from pathlib import Path
from urllib.parse import urlparse

import httpx
from strata.gguf import (
    AccessDeniedError,
    GatedModelError,
    GGUFError,
    GGUFFormatError,
    ModelInfo,
    ModelNotFoundError,
    RangeNotSupportedError,
    SourceError,
    TLSError,
    UnreachableError,
    inspect_model,
)
from strata.gguf.errors import BadMagicError, TruncatedError
from strata.gguf.sources import resolve_hf, status_error, transport_error
from strata.operator.reasons import Reason

_HEAD_TIMEOUT_SECONDS = 10.0

# The first class an error is an instance of decides; subclasses come before their bases.
_CAUSES: tuple[tuple[type[GGUFError], Reason], ...] = (
    (GatedModelError, Reason.MODEL_GATED),
    (AccessDeniedError, Reason.MODEL_ACCESS_DENIED),
    (ModelNotFoundError, Reason.MODEL_NOT_FOUND),
    (UnreachableError, Reason.MODEL_UNREACHABLE),
    (TLSError, Reason.MODEL_TLS_FAILED),
    (RangeNotSupportedError, Reason.MODEL_RANGE_IGNORED),
    (BadMagicError, Reason.MODEL_NOT_GGUF),
    (TruncatedError, Reason.MODEL_HEADER_TRUNCATED),
    (GGUFFormatError, Reason.MODEL_HEADER_INVALID),
)


class ModelUnreadable(Exception):
    """The model's header could not be read now; `reason` names the cause for the Planned condition."""

    def __init__(self, message: str, *, reason: Reason = Reason.MODEL_UNREADABLE) -> None:
        super().__init__(message)
        self.reason = reason


def unreadable(error: GGUFError, *, url: str) -> ModelUnreadable:
    reason = next((r for kind, r in _CAUSES if isinstance(error, kind)), Reason.MODEL_UNREADABLE)
    where = "" if isinstance(error, SourceError) else f" of {url}"  # a source error's message names the URL
    return ModelUnreadable(f"cannot read the GGUF header{where}: {error}", reason=reason)


def _version(url: str, token: str | None) -> str:
    if url.startswith("file://"):
        try:
            stat = Path(urlparse(url).path).stat()
        except FileNotFoundError:
            raise ModelNotFoundError(f"{urlparse(url).path}: no such file") from None
        return f"{stat.st_size}:{stat.st_mtime_ns}"
    target = resolve_hf(url) if url.startswith("hf://") else url
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        response = httpx.head(target, headers=headers, follow_redirects=True, timeout=_HEAD_TIMEOUT_SECONDS)
    except httpx.HTTPError as e:
        raise transport_error(target, e) from None
    if response.is_error:
        raise status_error(target, response, authorized=bool(token))
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
        except GGUFError as e:
            raise unreadable(e, url=url) from e
        except OSError as e:
            raise ModelUnreadable(f"cannot read the GGUF header of {url}: {e.strerror or e}") from e
        with self._lock:
            self._cache[key] = model
        return model
