"""The entry point the rest of Strata uses: name a model (path or URL), get its header or its ModelInfo.

Opening the source, reading the header and closing the source happen here, so callers never hold a connection.
"""

from __future__ import annotations

from strata.gguf.describe import describe
from strata.gguf.header import GGUFHeader, read_header
from strata.gguf.limits import DEFAULT_LIMITS, Limits
from strata.gguf.model import ModelInfo
from strata.gguf.sources import open_source


def read_model_header(
    source: str, *, token: str | None = None, limits: Limits = DEFAULT_LIMITS
) -> tuple[GGUFHeader, int | None]:
    """The raw header of `source` (path, file://, http(s)://, hf://) and the file's size when the source states it."""
    with open_source(source, token=token) as byte_source:
        header = read_header(byte_source, limits=limits)
        return header, byte_source.size


def inspect_model(source: str, *, token: str | None = None) -> ModelInfo:
    """ModelInfo for `source`, reading only its header; raises a GGUFError subclass on any failure."""
    header, file_bytes = read_model_header(source, token=token)
    return describe(header, file_bytes=file_bytes)
