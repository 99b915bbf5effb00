"""The coordinator's index of the prefix snapshots it asked the stages to keep: which one a prompt starts with.

Snapshots are taken at chunk-aligned lengths (multiples of `chunk` tokens) and named by a sha256 over the prefix's
token ids as int32 bytes. A snapshot of N positions also serves every shorter chunk-aligned prefix of the same
tokens (position i's K and V depend only on tokens 0..i), so each chunk boundary of a saved prefix is indexed: a
request that shares only a system prompt with an earlier one restores the shared chunks of the earlier snapshot.

The index is a hint, never the truth: a stage may have evicted a snapshot, restarted, or accepted a newer term.
Whoever restores checks every stage's answer and falls back to a full prefill on any miss, then forgets the
snapshot here. The pipeline keeps one index per plan generation and drops it when it takes a new term.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

DEFAULT_MAX_ENTRIES = 65_536  # chunk boundaries remembered (a few MB); the oldest go first


@dataclass(frozen=True)
class PrefixMatch:
    key: bytes  # the snapshot to restore from
    length: int  # how many of its positions: a multiple of the chunk, shorter than the prompt


def boundary_hashes(tokens: tuple[int, ...], *, chunk: int, limit: int) -> list[tuple[int, bytes]]:
    """(length, sha256 of tokens[:length]) for every multiple of `chunk` up to `limit`, shortest first."""
    hasher = hashlib.sha256()
    found = []
    for end in range(chunk, min(limit, len(tokens)) + 1, chunk):
        hasher.update(np.asarray(tokens[end - chunk : end], dtype=np.int32).tobytes())
        found.append((end, hasher.copy().digest()))
    return found


class PrefixIndex:
    def __init__(self, *, chunk: int, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if chunk < 1:
            raise ValueError(f"the prefix chunk must be at least one token, not {chunk}")
        self.chunk = chunk
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, bytes] = OrderedDict()  # hash of a chunk-aligned prefix -> snapshot key

    def __len__(self) -> int:
        return len(self._entries)

    def longest(self, prompt: tuple[int, ...]) -> PrefixMatch | None:
        """The longest indexed prefix of `prompt` that leaves at least one token to prefill (the last stage must
        sample from a real forward pass)."""
        for length, digest in reversed(boundary_hashes(prompt, chunk=self.chunk, limit=len(prompt) - 1)):
            key = self._entries.get(digest)
            if key is not None:
                self._entries.move_to_end(digest)
                return PrefixMatch(key=key, length=length)
        return None

    def covered(self, prompt: tuple[int, ...]) -> int:
        """How many leading tokens of `prompt` a known snapshot holds (0: none), without counting as a use: the
        router asks every pipeline's index, and only the one it picks restores."""
        for length, digest in reversed(boundary_hashes(prompt, chunk=self.chunk, limit=len(prompt) - 1)):
            if digest in self._entries:
                return length
        return 0

    def to_save(self, prompt: tuple[int, ...]) -> tuple[bytes, int] | None:
        """The (key, length) of the longest chunk-aligned prefix of a prefilled `prompt` that no snapshot covers."""
        hashes = boundary_hashes(prompt, chunk=self.chunk, limit=len(prompt))
        if not hashes or hashes[-1][1] in self._entries:
            return None
        length, key = hashes[-1]
        return key, length

    def add(self, prompt: tuple[int, ...], *, key: bytes, length: int) -> None:
        """Index every chunk boundary of the snapshot `key` of `prompt[:length]` (the stages now hold it)."""
        for _end, digest in boundary_hashes(prompt, chunk=self.chunk, limit=length):
            self._entries[digest] = key
            self._entries.move_to_end(digest)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def forget(self, key: bytes) -> None:
        """A stage no longer holds snapshot `key`: drop every boundary that points at it."""
        for digest in [d for d, k in self._entries.items() if k == key]:
            del self._entries[digest]

    def clear(self) -> None:
        self._entries.clear()
