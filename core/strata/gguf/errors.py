"""One exception hierarchy for everything that can go wrong reading a GGUF model.

A GGUF file is untrusted input (DESIGN.md, "Model metadata"): the operator reads headers of files that users point
at, so every failure must be a typed error a handler can catch once and turn into a condition a person can act on.
Format errors name the field being read and the byte offset where it starts, so a report pinpoints the damage.
"""

from __future__ import annotations


class GGUFError(Exception):
    """Base of every error raised while locating, fetching or decoding a GGUF model."""


class GGUFFormatError(GGUFError):
    """The bytes are not a GGUF header Strata accepts; `field` and `offset` say where reading stopped."""

    def __init__(self, *, field: str, offset: int, reason: str) -> None:
        super().__init__(f"{field} at byte {offset}: {reason}")
        self.field = field
        self.offset = offset
        self.reason = reason


class BadMagicError(GGUFFormatError):
    """The file does not start with the four bytes `GGUF`."""


class UnsupportedVersionError(GGUFFormatError):
    """A GGUF version this reader does not decode (only v2 and v3, little-endian)."""


class TruncatedError(GGUFFormatError):
    """The data ends before the header does."""


class LimitExceededError(GGUFFormatError):
    """A count or length is larger than any real model needs; refused before anything is allocated."""


class DuplicateKeyError(GGUFFormatError):
    """A metadata key or tensor name appears twice."""


class UnknownValueTypeError(GGUFFormatError):
    """A metadata value type outside GGUFValueType, or an array of arrays."""


class UnknownTensorTypeError(GGUFFormatError):
    """A tensor's ggml type is not one gguf-py knows the block size of."""


class MisalignedTensorError(GGUFFormatError):
    """A tensor's data offset is not a multiple of the alignment, or overlaps the tensor before it."""


class TooManyDimsError(GGUFFormatError):
    """A tensor with more dimensions than ggml supports (4)."""


class InvalidValueError(GGUFFormatError):
    """A value of the right type but an impossible content: bad UTF-8, a zero alignment, a bad shape."""


class MetadataError(GGUFFormatError):
    """The header decodes, but a key the model description needs is missing or has the wrong type."""


class SourceError(GGUFError):
    """The model could not be fetched: a missing file, an HTTP error, an unsupported URL scheme."""


class RangeNotSupportedError(SourceError):
    """The HTTP server ignored the Range header; Strata refuses to download a whole model to read its header."""


class ModelNotFoundError(SourceError):
    """No file at that path or URL (HTTP 404 or 410, or a missing local file)."""


class AccessDeniedError(SourceError):
    """The server refused the credentials sent, or their absence (HTTP 401 or 403, an unreadable local file)."""


class GatedModelError(AccessDeniedError):
    """A gated Hugging Face repository whose terms the token's account has not accepted."""


class UnreachableError(SourceError):
    """The server could not be reached: a host that does not resolve, a refused connection, a timeout."""


class TLSError(SourceError):
    """The TLS handshake failed: an untrusted certificate, or a server that does not speak TLS on that port."""
