"""Where a model's bytes come from: a local path, file://, http(s):// with Range requests, or hf://.

The header reader only ever asks for a byte range, so each source answers `read(offset, length)`. Over HTTP each
read is one Range request; a server that answers 200 (ignoring the Range) is refused before its body is read, so
inspecting a 40 GB model never downloads it. The Hugging Face token goes into a header only, never into a message.

A failed fetch becomes one typed error per cause (not found, access denied or gated, unreachable, TLS, Range ignored),
so the operator can name the cause in a condition; messages are written here, short, without the HTTP library's text
("For more information check: ...") or a traceback's worth of nested exceptions.
"""

from __future__ import annotations

import os
import re
import socket
import ssl
from pathlib import Path
from typing import BinaryIO, Self
from urllib.parse import quote, urlsplit
from urllib.request import url2pathname

import httpx
from strata.gguf.errors import (
    AccessDeniedError,
    GatedModelError,
    ModelNotFoundError,
    RangeNotSupportedError,
    SourceError,
    TLSError,
    UnreachableError,
)

DEFAULT_HF_ENDPOINT = "https://huggingface.co"
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class FileSource:
    """A local file, read with seek + read."""

    def __init__(self, path: Path) -> None:
        self.name = str(path)
        try:
            self._file: BinaryIO = path.open("rb")
        except FileNotFoundError:
            raise ModelNotFoundError(f"{path}: no such file") from None
        except PermissionError:
            raise AccessDeniedError(f"{path}: permission denied") from None
        except OSError as error:
            raise SourceError(f"cannot open {path}: {error.strerror or error}") from None
        self.size: int | None = os.fstat(self._file.fileno()).st_size

    def read(self, offset: int, length: int) -> bytes:
        self._file.seek(offset)
        return self._file.read(length)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HttpSource:
    """An http(s) URL read with one Range request per read; `size` is learned from Content-Range."""

    def __init__(self, url: str, *, token: str | None = None, timeout: float = 30.0) -> None:
        self.name = url
        headers = {"Accept-Encoding": "identity"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        # httpx drops Authorization when a redirect leaves the origin (Hugging Face redirects to its CDN).
        self._client = httpx.Client(headers=headers, follow_redirects=True, timeout=timeout)
        self._authorized = bool(token)
        self.size: int | None = None

    def read(self, offset: int, length: int) -> bytes:
        if length <= 0 or (self.size is not None and offset >= self.size):
            return b""
        request_range = f"bytes={offset}-{offset + length - 1}"
        try:
            with self._client.stream("GET", self.name, headers={"Range": request_range}) as response:
                return self._body(response, offset=offset, length=length)
        except httpx.HTTPError as error:
            raise transport_error(self.name, error) from None

    def _body(self, response: httpx.Response, *, offset: int, length: int) -> bytes:
        if response.status_code == httpx.codes.REQUESTED_RANGE_NOT_SATISFIABLE:
            return b""
        if response.status_code == httpx.codes.OK:
            raise RangeNotSupportedError(
                f"{self.name}: the server ignored the Range request (HTTP 200); refusing to download the whole file"
            )
        if response.status_code != httpx.codes.PARTIAL_CONTENT:
            raise status_error(self.name, response, authorized=self._authorized)
        match = _CONTENT_RANGE.fullmatch(response.headers.get("content-range", ""))
        if match is None or int(match[1]) != offset:
            raise SourceError(f"{self.name}: unexpected Content-Range {response.headers.get('content-range')!r}")
        if match[3] != "*":
            self.size = int(match[3])
        body = bytearray()
        for chunk in response.iter_bytes():
            body += chunk
            if len(body) > length:
                raise SourceError(f"{self.name}: the server sent more than the {length} bytes asked for")
        return bytes(body)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def status_error(url: str, response: httpx.Response, *, authorized: bool) -> SourceError:
    """The typed error for an HTTP answer that is not the file's bytes; `authorized`: a token was sent."""
    code = response.status_code
    status = f"HTTP {code} {response.reason_phrase}".rstrip()
    if code in (httpx.codes.NOT_FOUND, httpx.codes.GONE):
        return ModelNotFoundError(f"{url}: no such file ({status})")
    if code in (httpx.codes.UNAUTHORIZED, httpx.codes.FORBIDDEN):
        # Hugging Face marks a gated repository's refusal with this header, whatever the status code.
        if response.headers.get("x-error-code") == "GatedRepo":
            return GatedModelError(
                f"{url}: the repository is gated: the token's account must accept its terms on Hugging Face ({status})"
            )
        if authorized:
            return AccessDeniedError(f"{url}: the server refused the token ({status})")
        return AccessDeniedError(f"{url}: the server wants a token ({status}); set model.tokenSecretRef")
    if code in (httpx.codes.BAD_GATEWAY, httpx.codes.SERVICE_UNAVAILABLE, httpx.codes.GATEWAY_TIMEOUT):
        return UnreachableError(f"{url}: the server is unavailable ({status})")
    return SourceError(f"{url}: unexpected answer {status}")


def transport_error(url: str, error: httpx.HTTPError) -> SourceError:
    """The typed error for a request that got no HTTP answer, named by its root cause in the exception chain."""
    parts = urlsplit(url)
    host = parts.hostname or url
    where = f"{host}:{parts.port}" if parts.port else host
    if isinstance(error, httpx.TimeoutException):
        return UnreachableError(f"{url}: {where} did not answer in time ({type(error).__name__})")
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, ssl.SSLCertVerificationError):
            return TLSError(f"{url}: the certificate of {where} is not trusted ({cause.verify_message})")
        if isinstance(cause, ssl.SSLError):
            return TLSError(f"{url}: the TLS handshake with {where} failed ({cause.reason or cause.strerror})")
        if isinstance(cause, socket.gaierror):
            return UnreachableError(f"{url}: the host name {host} does not resolve")
        if isinstance(cause, ConnectionRefusedError):
            return UnreachableError(f"{url}: {where} refused the connection")
        if isinstance(cause, OSError) and cause.strerror:
            return UnreachableError(f"{url}: cannot connect to {where} ({cause.strerror})")
        cause = cause.__cause__ or cause.__context__
    return SourceError(f"{url}: {type(error).__name__}: {error}")


def resolve_hf(source: str, *, endpoint: str | None = None) -> str:
    """hf://ORG/REPO/PATH.gguf[@REVISION] -> {endpoint}/ORG/REPO/resolve/{REVISION or main}/PATH.gguf."""
    rest = source.removeprefix("hf://")
    path, _, revision = rest.rpartition("@") if "@" in rest else (rest, "", "")
    parts = path.split("/")
    if len(parts) < 3 or not all(parts):
        raise SourceError(f"{source!r} is not hf://ORG/REPO/PATH.gguf[@REVISION]")
    base = (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_HF_ENDPOINT).rstrip("/")
    repo, file_path = "/".join(parts[:2]), "/".join(parts[2:])
    return f"{base}/{repo}/resolve/{quote(revision or 'main', safe='')}/{quote(file_path)}"


Source = FileSource | HttpSource


def open_source(source: str, *, token: str | None = None) -> Source:
    """A byte source for a path or URL; hf:// uses `token`, else $HF_TOKEN."""
    scheme = urlsplit(source).scheme.lower()
    if scheme == "hf":
        return HttpSource(resolve_hf(source), token=token or os.environ.get("HF_TOKEN"))
    if scheme in ("http", "https"):
        return HttpSource(source, token=token)
    if scheme == "file":
        parts = urlsplit(source)
        if parts.netloc not in ("", "localhost"):
            raise SourceError(f"{source!r}: file:// URLs must name a local path")
        return FileSource(Path(url2pathname(parts.path)))
    if scheme and len(scheme) > 1:  # one letter is a Windows drive, not a scheme
        raise SourceError(f"{source!r}: unsupported scheme {scheme!r} (use a path, file://, http(s):// or hf://)")
    return FileSource(Path(source))
