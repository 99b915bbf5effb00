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

from dataclasses import dataclass

import torch
from strata.stage_worker.kv_pool import RawRows
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

    def offload(self, entry: list[RawRows]) -> list[HostRows]:
        """Host copies of one entry's device rows (gathered already, or views); counted against the budget."""
        copied = [self._copy_out(rows) for rows in entry]
        self._bytes += sum(rows.nbytes for rows in copied)
        self._offloaded += 1
        return copied

    def _copy_out(self, rows: RawRows) -> HostRows:
        if self._stream is None:
            return HostRows(rows=_to_host(rows, pinned=False), ready=None)
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)  # the rows' writes land before the copy reads them
        with torch.cuda.stream(self._stream):
            host = _to_host(rows, pinned=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self._stream)
        for tensor in (rows.values, rows.scales):
            if tensor is not None:
                tensor.record_stream(self._stream)  # not reused before the copy has read it
        current.wait_event(event)  # blocks the rows came from are reused only after the copy
        return HostRows(rows=host, ready=event)

    def bring_back(self, rows: HostRows, *, start: int, stop: int) -> RawRows:
        """Rows start..stop-1 on the device, usable on the compute stream."""
        part = rows.rows.rows(start, stop)
        if self._stream is None:
            return _to(part, self.device, non_blocking=False)
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            back = _to(part, self.device, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self._stream)
        current.wait_event(event)
        for tensor in (back.values, back.scales):
            if tensor is not None:
                tensor.record_stream(current)
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


def _to_host(rows: RawRows, *, pinned: bool) -> RawRows:
    def copy(tensor: Tensor) -> Tensor:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pinned)
        host.copy_(tensor, non_blocking=pinned)
        return host

    return RawRows(values=copy(rows.values), scales=None if rows.scales is None else copy(rows.scales))


def _to(rows: RawRows, device: torch.device, *, non_blocking: bool) -> RawRows:
    def move(tensor: Tensor) -> Tensor:
        return tensor.to(device, non_blocking=non_blocking)

    return RawRows(values=move(rows.values), scales=None if rows.scales is None else move(rows.scales))
