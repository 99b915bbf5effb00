"""Which pipeline a request goes to (pure): the one that holds its prompt's prefix, within a bound on its load.

A prompt's prefix cache lives on the stages of one pipeline, so a multi-turn chat only hits it when every turn goes
where the first one went. Two signals say where that is:

- the prefix index of each pipeline (strata.gateway.prefix_index): the prompt tokens a snapshot there already holds.
  The longest holder wins, as long as its load stays within the bound;
- consistent hashing of the prompt's first block (its first `block` tokens: the system prompt and the first turn of
  a chat, the same in every later turn) onto a ring of the pipelines. A prompt nobody holds yet goes to the first
  pipeline clockwise from its key that is within the bound, so the next turn of the same chat finds it there, and a
  pipeline that joins or leaves moves only the keys next to it on the ring.

The bound is consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018): a pipeline takes a new
request only while its busy lanes stay within `balance` times its share of all busy lanes, counting the new one,
plus one, so one hot prefix (a system prompt every user shares) spills over to the next pipelines on the ring
instead of crowding one pipeline's batch while the others idle. Shares are weighted by lanes: pipelines may be
planned with different parallel slots. The extra one matters only at low load, where the share rounds to a single
request: without it a chat's next turn would leave its cache whenever its own previous request was still releasing
its lane there (bench/pipelines.py measured 86% hits instead of 100% over 4 pipelines).

Round robin is here as the baseline the bench compares against (bench/pipelines.py).
"""

from __future__ import annotations

import bisect
import enum
import functools
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

POINTS_PER_PIPELINE = 64  # virtual nodes on the ring: spreads the keys evenly over a handful of pipelines
DEFAULT_BALANCE = 1.25  # the bound's slack over an even share (the paper's c); 1.25 keeps affinity under skew


class Policy(enum.StrEnum):
    PREFIX = "prefix"  # prefix-affine: the holder of the prompt's prefix, else its place on the ring
    ROUND_ROBIN = "round-robin"  # each request to the next pipeline with a free lane


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """A serving pipeline as routing sees it."""

    index: int
    lanes: int
    busy: int
    cached: int = 0  # prompt tokens a prefix snapshot on this pipeline holds

    @property
    def free(self) -> bool:
        return self.busy < self.lanes


def affinity_key(prompt: Sequence[int], *, block: int) -> int:
    """A 64-bit key of the prompt's first `block` tokens (all of them when it is shorter)."""
    head = np.asarray(prompt[:block], dtype=np.int32).tobytes()
    return int.from_bytes(hashlib.sha256(head).digest()[:8], "big")


def _point(index: int, replica: int) -> int:
    return int.from_bytes(hashlib.sha256(f"pipeline-{index}-{replica}".encode()).digest()[:8], "big")


@functools.lru_cache(maxsize=64)
def _ring(indices: tuple[int, ...], points: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ring's points in order and the pipeline each belongs to."""
    ring = sorted((_point(index, replica), index) for index in indices for replica in range(points))
    return tuple(p for p, _ in ring), tuple(i for _, i in ring)


def ring_order(key: int, indices: Sequence[int], *, points: int = POINTS_PER_PIPELINE) -> list[int]:
    """Every pipeline in `indices`, in the order met walking the ring clockwise from `key`."""
    positions, owners = _ring(tuple(sorted(set(indices))), points)
    if not positions:
        return []
    start = bisect.bisect_left(positions, key)
    order: list[int] = []
    for step in range(len(owners)):
        owner = owners[(start + step) % len(owners)]
        if owner not in order:
            order.append(owner)
            if len(order) == len(set(indices)):
                break
    return order


def within_bound(candidate: Candidate, candidates: Sequence[Candidate], *, balance: float) -> bool:
    """Whether `candidate` may take one more request: busy + 1 <= ceil(balance * (all busy + 1) * lane share) + 1."""
    lanes = sum(c.lanes for c in candidates)
    busy = sum(c.busy for c in candidates)
    return candidate.busy + 1 <= math.ceil(balance * (busy + 1) * candidate.lanes / lanes) + 1


def route(key: int, candidates: Sequence[Candidate], *, balance: float = DEFAULT_BALANCE) -> int | None:
    """The index of the pipeline for a request with affinity `key`; None when no candidate has a free lane.

    In order: the pipeline that holds the longest cached prefix, then the ring from `key`, each taken only with a free
    lane and within the bound; when every free one is over the bound, the least loaded free one.
    """
    free = [c for c in candidates if c.free]
    if not free:
        return None
    holder = max(free, key=lambda c: (c.cached, -c.index))
    if holder.cached > 0 and within_bound(holder, candidates, balance=balance):
        return holder.index
    by_index = {c.index: c for c in free}
    for index in ring_order(key, [c.index for c in candidates]):
        chosen = by_index.get(index)
        if chosen is not None and within_bound(chosen, candidates, balance=balance):
            return index
    return min(free, key=lambda c: (c.busy / c.lanes, c.index)).index


def round_robin(turn: int, candidates: Sequence[Candidate]) -> int | None:
    """The first candidate with a free lane from position `turn` (mod their count) on, in index order."""
    ordered = sorted(candidates, key=lambda c: c.index)
    for step in range(len(ordered)):
        chosen = ordered[(turn + step) % len(ordered)]
        if chosen.free:
            return chosen.index
    return None
