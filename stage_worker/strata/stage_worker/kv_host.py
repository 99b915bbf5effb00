"""The host tier: KV rows a stage's device pool let go of, kept in host memory within a byte budget to come back on a
prefix hit instead of being computed again.

The prefix cache (strata.stage_worker.prefix_cache) lends its pinned blocks back to the pool when a slot runs short
and drops its least recently used snapshots over its device budget; with a host tier, such a snapshot's rows move
here first (the rows exactly as stored, q8_0 values and scales alike, so they come back bit for bit) and a later
restore writes them into fresh blocks. SGLang's HiCache and vLLM's offloading connector do the same between GPU and
host; both report a restore far cheaper than recomputing a long prefix.

On CUDA the rows go to pinned host memory on a copy stream of their own: the copy waits for the compute stream's
writes, and the compute stream waits for the copy (an event, on the device, never the host) before anything reuses the
blocks it read or reads the rows it brought back, so neither direction stalls the host thread. On a CPU they are plain
tensors, copied at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from strata.stage_worker.kv_stores import RawRows
from torch import Tensor


@dataclass(frozen=True)
class HostRows:
    """One layer's K or V rows in host memory, and the event after which they are there (None: already there)."""

    rows: RawRows
    ready: torch.cuda.Event | None

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes

    def wait(self) -> None:
        """Block the host until the rows are in host memory (before their memory may be reused)."""
        if self.ready is not None:
            self.ready.synchronize()


@dataclass(frozen=True)
class HostTierStats:
    entries: int
    bytes_held: int
    budget_bytes: int
    offloaded: int  # entries written here
    restored: int  # entries brought back to the device
    dropped: int  # entries let go over the budget


class HostTier:
    """Copies rows between a device's stores and host memory; a budget of 0 keeps nothing.

    The tier moves rows and counts bytes; which entries to keep is the prefix cache's (it holds them, oldest first,
    and calls `fits`, `held` and `let_go` under its own lock)."""

    def __init__(self, *, budget_bytes: int, device: torch.device) -> None:
        if budget_bytes < 0:
            raise ValueError(f"the host KV budget must not be negative, not {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.device = device
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device=device) if self._cuda else None  # type: ignore[no-untyped-call]
        self._bytes = 0
        self._offloaded = self._restored = self._dropped = 0

    def fits(self, nbytes: int) -> bool:
        return 0 < nbytes <= self.budget_bytes

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self._bytes

    def offload(self, entry: list[list[RawRows]]) -> list[HostRows]:
        """Host copies of one entry: each item's pieces (views of a store's rows, in position order) become one host
        RawRows. Views, not gathered copies: moving a 128K-token prefix takes no device memory of its own."""
        copied = [self._copy_out(pieces) for pieces in entry]
        self._bytes += sum(rows.nbytes for rows in copied)
        self._offloaded += 1
        return copied

    def _copy_out(self, pieces: list[RawRows]) -> HostRows:
        if self._stream is None:
            return HostRows(rows=_to_host(pieces, pinned=False), ready=None)
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)  # the rows' writes land before the copy reads them
        with torch.cuda.stream(self._stream):
            host = _to_host(pieces, pinned=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self._stream)
        current.wait_event(event)  # blocks the rows came from are written again only after the copy
        return HostRows(rows=host, ready=event)

    def bring_back(self, rows: HostRows, *, into: list[RawRows], start: int = 0) -> None:
        """Host rows start.. written into `into` (views of a store's rows, in position order), ready for the compute
        stream: straight into the blocks, no device copy in between."""
        rows.wait()  # an entry offloaded moments ago may still be on its way
        if self._stream is None:
            _copy_into(into, rows.rows, start=start, non_blocking=False)
            return
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)  # the blocks' earlier readers and writers go first
        with torch.cuda.stream(self._stream):
            _copy_into(into, rows.rows, start=start, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self._stream)
        current.wait_event(event)

    def fetch(self, rows: HostRows, *, start: int, stop: int) -> RawRows:
        """Host rows start..stop-1 as a device copy, for rows whose cells are scattered (a window's)."""
        rows.wait()
        part = rows.rows.rows(start, stop)
        back = RawRows(
            values=torch.empty_like(part.values, device=self.device),
            scales=None if part.scales is None else torch.empty_like(part.scales, device=self.device),
        )
        self.bring_back(HostRows(rows=part, ready=None), into=[back])
        return back

    def restored(self, entry_bytes: int) -> None:
        """An entry went back to the device: its host memory is free again."""
        self._bytes -= entry_bytes
        self._restored += 1

    def let_go(self, entry_bytes: int, rows: list[HostRows]) -> None:
        """An entry is dropped over the budget (or forgotten): wait for its copies, then free its bytes."""
        for part in rows:
            part.wait()
        self._bytes -= entry_bytes
        self._dropped += 1

    def stats(self, entries: int) -> HostTierStats:
        return HostTierStats(
            entries=entries,
            bytes_held=self._bytes,
            budget_bytes=self.budget_bytes,
            offloaded=self._offloaded,
            restored=self._restored,
            dropped=self._dropped,
        )


def block_runs(blocks: Sequence[int], *, size: int, length: int) -> list[tuple[int, int]]:
    """(first row, rows) of the store ranges that hold positions 0..length-1 of a slot with these blocks, in order:
    consecutive blocks make one range, so a prefix the allocator handed out in order moves in a few copies."""
    runs: list[tuple[int, int]] = []
    left = length
    for block in blocks:
        if left <= 0:
            break
        rows = min(size, left)
        if runs and runs[-1][0] + runs[-1][1] == block * size:
            runs[-1] = (runs[-1][0], runs[-1][1] + rows)
        else:
            runs.append((block * size, rows))
        left -= rows
    return runs


def _to_host(pieces: list[RawRows], *, pinned: bool) -> RawRows:
    """One host RawRows holding the pieces one after another."""

    def gather(parts: list[Tensor]) -> Tensor:
        total = sum(part.shape[0] for part in parts)
        host = torch.empty((total, *parts[0].shape[1:]), dtype=parts[0].dtype, device="cpu", pin_memory=pinned)
        offset = 0
        for part in parts:
            host[offset : offset + part.shape[0]].copy_(part, non_blocking=pinned)
            offset += part.shape[0]
        return host

    scales = [piece.scales for piece in pieces if piece.scales is not None]
    return RawRows(values=gather([piece.values for piece in pieces]), scales=gather(scales) if scales else None)


def _copy_into(into: list[RawRows], rows: RawRows, *, start: int, non_blocking: bool) -> None:
    """rows start.. copied into the views one after another."""
    offset = start
    for view in into:
        part = rows.rows(offset, offset + view.values.shape[0])
        view.values.copy_(part.values, non_blocking=non_blocking)
        if view.scales is not None and part.scales is not None:
            view.scales.copy_(part.scales, non_blocking=non_blocking)
        offset += view.values.shape[0]
