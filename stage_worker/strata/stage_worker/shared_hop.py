"""Activations between two stages on one host through shared memory instead of through gRPC.

A 4,096-position bf16 hidden state is 32 MiB; as protobuf bytes over loopback gRPC it took about 300 ms on an H100
host (five copies and the HTTP/2 round trip), twice a whole prefill on one stage. Between stages that share a host
the tensor goes through memory both map, and the Forward request carries only a reference to it (SharedTensor).

The receiving stage owns the region (`HopRegion`): a file in /dev/shm made when the stage loads, holding a header (a
magic, a random token, the layout), one sequence number per slot, then the slots, each sized for
`hop_slot_positions` of its hidden states. The stage advertises it in its load status. A sender uses it
(`HopLink`, `HopWriter`) only where it can open that file and finds the same token in it, which proves the two share
a host; otherwise, and for a step larger than a slot, activations go inline as before.

A slot is the sender's from the moment it takes one until the next stage answers that step or the step fails. It sets
the slot's sequence number to 0, copies the tensor in, then writes the step's number, which the reference carries
too. The receiver refuses a reference that does not fit its region, and copies the slot out only while its number is
the reference's, both before and after the copy (a seqlock): a slot written again meanwhile, by a sender whose step
had failed or by a second sender, is refused by name, never read half-written. Stores through the mapping reach the
other process in program order on x86-64 (total store order), where the stages run.

The owner unlinks the file when it stops (on SIGTERM too) and at interpreter exit. A stage killed with SIGKILL leaves
its file behind; the next stage to make a region on the host removes every such file whose owner, named in the file
name by pid and process start time, no longer runs. (Stages in separate pid namespaces see each other's owners as
gone; in Kubernetes each pod has /dev/shm of its own, so it never comes up there.)
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import mmap
import os
import re
import secrets
import struct
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from strata.rpc.v1 import stage_pb2
from strata.stage_worker.errors import InvalidRequestError
from strata.stage_worker.wire import WIRE_DTYPES
from torch import Tensor

SHM = Path("/dev/shm")  # noqa: S108  # files made O_EXCL, mode 0600, under random names
PREFIX = "strata-hop-"
NAME = re.compile(r"strata-hop-(\d+)-(\d+)-[0-9a-f]{16}")  # pid, process start time (clock ticks since boot), random
MAGIC = b"strata-hop-v1\0\0\0"
HEADER = struct.Struct("<16s16sIQ")  # magic, token, slots, slot bytes
SEQUENCE = struct.Struct("<Q")
SEQUENCES_AT = 64
PAGE = 4096
RETRY_S = 1.0  # how long a sender goes inline before asking a next stage that is still loading (or silent) again


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _started(pid: int) -> int | None:
    """When the process `pid` started, in clock ticks since boot; None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])  # field 22; the name before ")" may hold spaces


def sweep_stale(folder: Path = SHM) -> list[str]:
    """Remove the region files of owners that no longer run (a stage killed with SIGKILL); the names removed."""
    removed = []
    for path in folder.glob(PREFIX + "*"):
        match = NAME.fullmatch(path.name)
        if match is not None and _started(int(match.group(1))) != int(match.group(2)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path.name)
    return removed


@dataclass(frozen=True)
class Layout:
    slots: int
    slot_bytes: int  # a multiple of the page size

    @property
    def data_at(self) -> int:
        return _round_up(SEQUENCES_AT + SEQUENCE.size * self.slots, PAGE)

    @property
    def size(self) -> int:
        return self.data_at + self.slots * self.slot_bytes


class _Mapping:
    """A region's file mapped into this process: the slots' sequence numbers and bytes."""

    def __init__(self, fd: int, layout: Layout) -> None:
        self.layout = layout
        self.map = mmap.mmap(fd, layout.size)
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)  # [size], shares the mapping

    def sequence(self, slot: int) -> int:
        value: int = SEQUENCE.unpack_from(self.map, SEQUENCES_AT + SEQUENCE.size * slot)[0]
        return value

    def set_sequence(self, slot: int, value: int) -> None:
        SEQUENCE.pack_into(self.map, SEQUENCES_AT + SEQUENCE.size * slot, value)

    def _start(self, slot: int) -> int:
        return self.layout.data_at + slot * self.layout.slot_bytes

    # Between host memory, one memcpy on the calling thread: torch's copy would wake its worker threads, and on a busy
    # host that wake-up costs more than the copy (10-20 ms against 0.1 ms for 1 MiB on the 2-core dev machine).

    def write(self, slot: int, tensor: Tensor) -> None:
        start, nbytes = self._start(slot), tensor.numel() * tensor.element_size()
        if tensor.device.type == "cpu":
            self.map[start : start + nbytes] = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data
        else:
            self.bytes[start : start + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)

    def read(self, slot: int, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device) -> Tensor:
        start, nbytes = self._start(slot), math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype, device=device)
        if device.type == "cpu":
            return torch.frombuffer(bytearray(memoryview(self.map)[start : start + nbytes]), dtype=dtype).view(shape)
        return self.bytes[start : start + nbytes].view(dtype).view(shape).to(device)


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


class HopRegion:
    """The receiving stage's region: made, advertised, read from and removed by its owner."""

    def __init__(self, *, slots: int, slot_bytes: int, folder: Path = SHM) -> None:
        sweep_stale(folder)
        pid = os.getpid()
        self.name = f"{PREFIX}{pid}-{_started(pid)}-{secrets.token_hex(8)}"
        self.token = secrets.token_bytes(16)
        self.layout = Layout(slots=slots, slot_bytes=_round_up(slot_bytes, PAGE))
        self.path = folder / self.name
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._remove = weakref.finalize(self, _unlink, self.path)  # at close() or, failing that, at exit
        try:
            os.posix_fallocate(fd, 0, self.layout.size)  # a full /dev/shm fails here, not with SIGBUS at a copy
            self._mapping = _Mapping(fd, self.layout)
        except BaseException:
            self._remove()
            raise
        finally:
            os.close(fd)
        HEADER.pack_into(self._mapping.map, 0, MAGIC, self.token, slots, self.layout.slot_bytes)

    def advert(self) -> stage_pb2.SharedRegion:
        return stage_pb2.SharedRegion(
            name=self.name, token=self.token, slots=self.layout.slots, slot_bytes=self.layout.slot_bytes
        )

    def read(self, ref: stage_pb2.SharedTensor, *, device: torch.device) -> Tensor:
        """The tensor `ref` names, copied out of its slot onto `device`; refuses a reference that does not fit the
        region or a slot that does not hold (or stopped holding) the reference's sequence number."""
        where = f"shared region {self.name}"
        if ref.region != self.name:
            raise InvalidRequestError(f"the activations are in shared region {ref.region!r}, not in this stage's")
        if ref.slot >= self.layout.slots:
            raise InvalidRequestError(f"slot {ref.slot} is outside {where}, which has {self.layout.slots}")
        if ref.dtype not in WIRE_DTYPES:
            raise InvalidRequestError(f"tensor dtype {ref.dtype!r} is not one of {', '.join(WIRE_DTYPES)}")
        dtype, shape = WIRE_DTYPES[ref.dtype], tuple(ref.shape)
        if any(d < 0 for d in shape):
            raise InvalidRequestError(f"tensor shape {shape} has a negative dimension")
        if (nbytes := math.prod(shape) * dtype.itemsize) > self.layout.slot_bytes:
            raise InvalidRequestError(
                f"a {ref.dtype} tensor of shape {shape} takes {nbytes} bytes; a slot of {where} holds "
                f"{self.layout.slot_bytes}"
            )
        self._check(ref, where, "")
        tensor = self._mapping.read(ref.slot, dtype, shape, device)
        self._check(ref, where, " while it was read")
        return tensor

    def _check(self, ref: stage_pb2.SharedTensor, where: str, when: str) -> None:
        if (held := self._mapping.sequence(ref.slot)) != ref.sequence:
            raise InvalidRequestError(
                f"slot {ref.slot} of {where} held sequence {held}{when}, not the request's {ref.sequence}: "
                "the slot was written again, or never"
            )

    def close(self) -> None:
        """Remove the file; senders still attached keep their mapping, a new sender can no longer open it."""
        self._remove()


class HopWriter:
    """A sender's side of the next stage's region: the file mapped here, and which slots this process holds."""

    def __init__(self, region: stage_pb2.SharedRegion, mapping: _Mapping) -> None:
        self.region = region
        self._mapping = mapping
        self._free = list(range(region.slots))
        self._changed = threading.Condition()
        self._sequences = itertools.count(secrets.randbelow(1 << 48) + 1)  # apart from another sender's

    @classmethod
    def attach(cls, region: stage_pb2.SharedRegion, *, folder: Path = SHM) -> HopWriter | None:
        """The region mapped here, or None where it cannot be opened or holds another token (another host)."""
        if NAME.fullmatch(region.name) is None or region.slots < 1 or region.slot_bytes % PAGE:
            return None
        layout = Layout(slots=region.slots, slot_bytes=region.slot_bytes)
        try:
            fd = os.open(folder / region.name, os.O_RDWR)
        except OSError:
            return None
        try:
            if os.fstat(fd).st_size != layout.size:
                return None
            mapping = _Mapping(fd, layout)
        finally:
            os.close(fd)
        if HEADER.unpack_from(mapping.map, 0) != (MAGIC, region.token, region.slots, region.slot_bytes):
            return None
        return cls(region, mapping)

    def serves(self, region: stage_pb2.SharedRegion) -> bool:
        return region.name == self.region.name and region.token == self.region.token

    def write(self, tensor: Tensor, *, timeout_s: float) -> tuple[stage_pb2.SharedTensor, Callable[[], None]] | None:
        """Copy `tensor` into a free slot, waiting at most `timeout_s` for one: its reference, and what frees the
        slot. None for a tensor larger than a slot, or when no slot came free in time: it goes inline."""
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in WIRE_DTYPES or tensor.numel() * tensor.element_size() > self.region.slot_bytes:
            return None
        with self._changed:
            if not self._changed.wait_for(lambda: self._free, timeout=timeout_s):
                return None
            slot = self._free.pop()
            sequence = next(self._sequences)
        self._mapping.set_sequence(slot, 0)
        self._mapping.write(slot, tensor)
        self._mapping.set_sequence(slot, sequence)
        ref = stage_pb2.SharedTensor(
            region=self.region.name, slot=slot, sequence=sequence, dtype=dtype, shape=tuple(tensor.shape)
        )
        return ref, functools.partial(self._release, slot)

    def _release(self, slot: int) -> None:
        with self._changed:
            self._free.append(slot)
            self._changed.notify()


class HopLink:
    """The sender's way to the next stage's region, from the next stage's load status: asked for on first use, every
    RETRY_S while the next stage is still loading (or does not answer), and again after a call to it failed (it may
    have come back as a new process, with a region of its own). A loaded stage's answer stands until then, whether
    this stage could attach to its region or not."""

    def __init__(self, status: Callable[[], stage_pb2.LoadStatus | None], *, folder: Path = SHM) -> None:
        self._status = status  # the next stage's load status; None when it could not be asked
        self._folder = folder
        self._lock = threading.Lock()
        self._writer: HopWriter | None = None
        self._ask_at = 0.0  # monotonic time to ask again; infinite once a loaded stage answered

    def writer(self) -> HopWriter | None:
        with self._lock:
            if time.monotonic() >= self._ask_at:
                status = self._status()
                region = status.hop_region if status is not None and status.hop_region.name else None
                if region is None:
                    self._writer = None
                elif self._writer is None or not self._writer.serves(region):
                    self._writer = HopWriter.attach(region, folder=self._folder)
                loaded = status is not None and status.loaded
                self._ask_at = math.inf if loaded else time.monotonic() + RETRY_S
            return self._writer

    def ask_again(self) -> None:
        """Check the region at the next use; without the lock, so a failing stream's reader never waits on a
        question to the next stage."""
        self._ask_at = 0.0
