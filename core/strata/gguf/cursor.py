"""Sequential reads over a random-access byte source, in geometrically growing windows, within the header budget.

Asking the source for one window at a time, doubling each time it runs out, keeps the number of HTTP Range requests
logarithmic and the bytes fetched within about twice the header's size. Every length passes through `take`, which
refuses to go past Limits.max_header_bytes, and every count through `count`, which bounds it before anything is
allocated.
"""

from __future__ import annotations

import struct
from typing import Protocol

from strata.gguf.errors import InvalidValueError, LimitExceededError, TruncatedError
from strata.gguf.limits import Limits


class ByteSource(Protocol):
    """Random access to the bytes of a model; `read` returns fewer bytes than asked only at the end of the data."""

    @property
    def name(self) -> str: ...

    def read(self, offset: int, length: int) -> bytes: ...


class Cursor:
    """Sequential reads over a ByteSource, fetching geometrically growing windows and bounding the header size."""

    def __init__(self, source: ByteSource, *, limits: Limits) -> None:
        self._source = source
        self._limits = limits
        self._buffer = bytearray()
        self._window = limits.first_window
        self._eof = False
        self.pos = 0
        self.bytes_fetched = 0
        self.requests = 0

    @property
    def limits(self) -> Limits:
        return self._limits

    def take(self, length: int, *, field: str) -> bytes:
        start, end = self.pos, self.pos + length
        if end > self._limits.max_header_bytes:
            raise LimitExceededError(
                field=field, offset=start, reason=f"header would exceed {self._limits.max_header_bytes} bytes"
            )
        while len(self._buffer) < end and not self._eof:
            want = max(end - len(self._buffer), min(self._window, self._limits.max_header_bytes - len(self._buffer)))
            chunk = self._source.read(len(self._buffer), want)
            self.requests += 1
            self.bytes_fetched += len(chunk)
            self._buffer += chunk
            self._eof = len(chunk) < want
            self._window = min(self._window * 2, self._limits.max_window)
        if len(self._buffer) < end:
            reason = f"needs {length} bytes, data ends at byte {len(self._buffer)}"
            raise TruncatedError(field=field, offset=start, reason=reason)
        self.pos = end
        return bytes(self._buffer[start:end])

    def unpack(self, fmt: str, *, field: str) -> tuple[int | float | bool, ...]:
        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt), field=field))

    def u32(self, *, field: str) -> int:
        return int(self.unpack("I", field=field)[0])

    def u64(self, *, field: str) -> int:
        return int(self.unpack("Q", field=field)[0])

    def count(self, *, field: str, limit: int, min_item_bytes: int) -> int:
        """A u64 count, refused when above `limit` or when its items could not fit in the header budget."""
        offset = self.pos
        value = self.u64(field=field)
        budget = (self._limits.max_header_bytes - self.pos) // max(min_item_bytes, 1)
        if value > min(limit, budget):
            raise LimitExceededError(field=field, offset=offset, reason=f"count {value} exceeds {min(limit, budget)}")
        return value

    def string(self, *, field: str, errors: str = "strict") -> str:
        offset = self.pos
        length = self.count(field=f"{field} length", limit=self._limits.max_string_bytes, min_item_bytes=1)
        raw = self.take(length, field=field)
        try:
            return raw.decode("utf-8", errors=errors)
        except UnicodeDecodeError as error:
            raise InvalidValueError(field=field, offset=offset, reason=f"not UTF-8 ({error.reason})") from None
