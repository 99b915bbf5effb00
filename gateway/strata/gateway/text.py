"""Turning sampled ids back into text as they arrive: incremental decoding and stop strings.

A token can end in the middle of a UTF-8 character, so text is released only once it decodes cleanly (the offsets
trick of HF text-generation-inference). A stop string can span tokens, so text that could still become the start of
a stop string is held back until the next token settles it; a matched stop string and everything after it is cut.
"""

from __future__ import annotations

from collections.abc import Sequence

from strata.gateway.tokenizer import GGUFTokenizer


class TextAssembler:
    def __init__(self, tokenizer: GGUFTokenizer, *, stops: Sequence[str]) -> None:
        self._tokenizer = tokenizer
        self._stops = tuple(stops)
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._pending = ""
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Text safe to send after `token_id`; sets `stopped` when a stop string matched."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        before = self._tokenizer.decode(self._ids[self._prefix : self._read])
        after = self._tokenizer.decode(self._ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._pending += after[len(before) :]
            self._prefix, self._read = self._read, len(self._ids)
        return self._release()

    def flush(self) -> str:
        """Whatever is held back, once no more tokens will come."""
        if self.stopped:
            return ""
        text, self._pending = self._pending, ""
        return text

    def _release(self) -> str:
        cut = min((i for i in (self._pending.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            text, self._pending = self._pending[:cut], ""
            return text
        hold = max((_overlap(self._pending, stop) for stop in self._stops), default=0)
        text = self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(self._pending) - hold :]
        return text


def _overlap(text: str, stop: str) -> int:
    """The length of the longest end of `text` that begins `stop`."""
    for length in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:length]):
            return length
    return 0
