"""The coordinator's index of the prefix snapshots it asked the stages to keep: which one a prompt starts with.

A prompt is keyed block by block (vLLM's prefix caching): block i's hash is sha256(block i-1's hash, the block's
token ids as int32), and block 0 chains from a seed naming the model, the KV cache type and a salt, salted again by
a request's `cache_salt` (vLLM's field) where it has one. So a hash names the whole prefix up to its block and
nothing else, and two deployments (or cache types, or salts) never share a key: a tenant that salts its requests
neither restores another's prefixes nor learns from a fast first token that another sent the same prompt.
Only final tokens are hashed: the coordinator saves prompt prefixes once their prefill is done, and drafted or
rolled-back positions come after the prompt.

Snapshots are taken at chunk-aligned lengths (multiples of `chunk` tokens, itself whole blocks) and named by the
hash of their last block. A snapshot of N positions also serves every shorter block-aligned prefix of the same
tokens (position i's K and V depend only on tokens 0..i), so each block boundary of a saved prefix is indexed: a
request that shares only a system prompt with an earlier one restores the shared blocks of the earlier snapshot.
The coordinator picks the hit length here and names it in the restore, so every stage restores the same positions.

The index is a hint, never the truth: a stage may have evicted a snapshot, restarted, or accepted a newer term.
Whoever restores checks every stage's answer and falls back to a full prefill on any miss, then forgets the
snapshot here. The pipeline keeps one index per plan generation and drops it when it takes a new term.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
from strata.kv_layout import BLOCK_TOKENS

DEFAULT_MAX_ENTRIES = 65_536  # block boundaries remembered (a few MB); the oldest go first


@dataclass(frozen=True)
class PrefixMatch:
    key: bytes  # the snapshot to restore from
    length: int  # how many of its positions: a multiple of the block, shorter than the prompt


def prefix_seed(*, model: str, cache_type: str, salt: str = "") -> bytes:
    """The hash block 0 chains from: each part length-prefixed, so no two different triples spell the same bytes."""
    hasher = hashlib.sha256(b"strata-kv-prefix-v1")
    for part in (model, cache_type, salt):
        encoded = part.encode()
        hasher.update(len(encoded).to_bytes(8, "little") + encoded)
    return hasher.digest()


def salted(seed: bytes, salt: str) -> bytes:
    """A request's seed: the deployment's, length-prefixed with the request's cache salt, so that no salt's prompts
    hash as another's (nor as unsalted ones)."""
    encoded = salt.encode()
    return hashlib.sha256(b"strata-kv-salt-v1" + seed + len(encoded).to_bytes(8, "little") + encoded).digest()


def block_hashes(tokens: tuple[int, ...], *, block: int, seed: bytes, limit: int) -> list[tuple[int, bytes]]:
    """(length, chained hash of tokens[:length]) for every multiple of `block` up to `limit`, shortest first."""
    found = []
    previous = seed
    for end in range(block, min(limit, len(tokens)) + 1, block):
        previous = hashlib.sha256(previous + np.asarray(tokens[end - block : end], dtype=np.int32).tobytes()).digest()
        found.append((end, previous))
    return found


class PrefixIndex:
    def __init__(
        self, *, chunk: int, seed: bytes = b"", block: int | None = None, max_entries: int = DEFAULT_MAX_ENTRIES
    ) -> None:
        if chunk < 1:
            raise ValueError(f"the prefix chunk must be at least one token, not {chunk}")
        # The pool's block, or the chunk itself where a chunk is smaller or does not hold whole blocks.
        self.block = math.gcd(chunk, BLOCK_TOKENS) if block is None else block
        if self.block < 1 or chunk % self.block:
            raise ValueError(f"the prefix chunk ({chunk} tokens) must hold whole hash blocks of {self.block} tokens")
        self.chunk = chunk
        self.seed = seed
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, bytes] = OrderedDict()  # hash of a block-aligned prefix -> snapshot key

    def __len__(self) -> int:
        return len(self._entries)

    def hashes(self, prompt: tuple[int, ...], *, limit: int, salt: str = "") -> list[tuple[int, bytes]]:
        """The chained hashes of the prompt's whole blocks up to `limit` tokens, from the seed salted by the request's
        `salt` (a request without one chains from the deployment's seed itself)."""
        seed = self.seed if not salt else salted(self.seed, salt)
        return block_hashes(prompt, block=self.block, seed=seed, limit=limit)

    def longest(self, prompt: tuple[int, ...], *, salt: str = "") -> PrefixMatch | None:
        """The longest indexed prefix of `prompt` that leaves at least one token to prefill (the last stage must
        sample from a real forward pass)."""
        for length, digest in reversed(self.hashes(prompt, limit=len(prompt) - 1, salt=salt)):
            key = self._entries.get(digest)
            if key is not None:
                self._entries.move_to_end(digest)
                return PrefixMatch(key=key, length=length)
        return None

    def covered(self, prompt: tuple[int, ...], *, salt: str = "") -> int:
        """How many leading tokens of `prompt` a known snapshot holds (0: none), without counting as a use: the
        router asks every pipeline's index, and only the one it picks restores."""
        for length, digest in reversed(self.hashes(prompt, limit=len(prompt) - 1, salt=salt)):
            if digest in self._entries:
                return length
        return 0

    def to_save(self, prompt: tuple[int, ...], *, salt: str = "") -> tuple[bytes, int] | None:
        """The (key, length) of the longest chunk-aligned prefix of a prefilled `prompt` that no snapshot covers."""
        length = len(prompt) - len(prompt) % self.chunk
        hashes = self.hashes(prompt, limit=length, salt=salt)
        if not hashes or hashes[-1][1] in self._entries:
            return None
        return hashes[-1][1], length

    def add(self, prompt: tuple[int, ...], *, key: bytes, length: int, salt: str = "") -> None:
        """Index every block boundary of the snapshot `key` of `prompt[:length]` (the stages now hold it)."""
        for _end, digest in self.hashes(prompt, limit=length, salt=salt):
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
