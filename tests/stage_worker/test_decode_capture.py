"""Where a decode step is captured: on a stream the stage made on its own device, with that device current.

torch.cuda.graph captures on one default stream per process, made on whichever device was current at the first
capture; a second stage on another GPU of the same process (the GPU tests drive several, and so do the benches)
would capture on a stream of the first one's device. The real capture needs a GPU (tests/gpu/test_device_placement.py
runs it there); here torch.cuda's graph, stream and device-guard calls are replaced by stand-ins that record the
device each was given, so CI checks what the decoder asks for on every build. The step's body runs eagerly on the
CPU inside the stand-in capture, as it does inside a real one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from strata.gguf import read_header
from strata.gguf.model import CacheType
from strata.gguf.sources import open_source
from strata.stage_worker.engine import Chunk, Engine
from strata.stage_worker.kv_pool import KVPool
from strata.stage_worker.loader import LoadProgress, load_stage


@dataclass(eq=False)
class FakeStream:
    device: torch.device

    def wait_stream(self, other: FakeStream) -> None:
        """Orders nothing: the stand-in runs every kernel at once on the CPU."""


class FakeGraph:
    def replay(self) -> None:
        """The captured body already ran (eagerly, inside the stand-in capture)."""


@dataclass
class Recorder:
    """The stand-in CUDA API, and what the decoder asked of it."""

    current: list[torch.device] = field(default_factory=list)  # the device-guard stack
    streams_made: list[FakeStream] = field(default_factory=list)
    captures: list[tuple[torch.device | None, FakeStream | None]] = field(default_factory=list)  # (current, stream)

    @contextmanager
    def device(self, device: torch.device) -> Iterator[None]:
        self.current.append(torch.device(device))
        try:
            yield
        finally:
            self.current.pop()

    def stream_on(self, device: torch.device | None = None) -> FakeStream:
        made = FakeStream(torch.device(device) if device is not None else torch.device("cuda", 0))
        self.streams_made.append(made)
        return made

    @contextmanager
    def graph(self, graph: FakeGraph, *, pool: object = None, stream: FakeStream | None = None) -> Iterator[None]:
        self.captures.append((self.current[-1] if self.current else None, stream))
        yield

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "device", self.device)
        monkeypatch.setattr(cuda, "Stream", self.stream_on)
        monkeypatch.setattr(cuda, "current_stream", lambda device=None: FakeStream(torch.device(device or "cuda:0")))
        monkeypatch.setattr(cuda, "stream", lambda _stream: _nothing())
        monkeypatch.setattr(cuda, "CUDAGraph", FakeGraph)
        monkeypatch.setattr(cuda, "graph", self.graph)
        monkeypatch.setattr(cuda, "graph_pool_handle", lambda: (0, 1))


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def captured_engine(path: Path, device: torch.device) -> Engine:
    """The whole tiny model as one stage on `device`, with CUDA graphs asked for (eager blocks inside them)."""
    source = open_source(str(path))
    try:
        model = load_stage(
            source=source, header=read_header(source), layer_start=0, layer_end=3, dtype=torch.float32,
            device=device, progress=LoadProgress(),
        )  # fmt: skip
    finally:
        source.close()
    c = model.config
    pool = KVPool(
        n_layers=3, context=32, parallel=2, key_width=c.kv_dim, value_width=c.kv_dim, type_k=CacheType.F32,
        type_v=CacheType.F32, dtype=torch.float32, device=device,
    )  # fmt: skip
    return Engine(model=model, pool=pool, device=device, dtype=torch.float32, cuda_graphs=True, compiled=False)


def test_each_capture_is_on_a_stream_of_the_stages_device_with_that_device_current(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = Recorder()
    recorder.install(monkeypatch)  # before the engine: its decoder makes its capture stream when it is built
    stage = captured_engine(tiny_models["llama"], torch.device("cpu"))
    stage.warm_up()
    stage.step([Chunk(slot=0, start_position=0, length=1, token_ids=(5,), sample=True)], None)

    assert len(recorder.captures) == 2, "one capture per batch size the warm-up covers (1 and 2 slots)"
    for current, stream in recorder.captures:
        assert current == stage.device, "the stage's device is current while it captures"
        assert stream is not None, "the capture names its stream: torch's default one is per process, not per device"
        assert stream.device == stage.device
    assert all(made.device == stage.device for made in recorder.streams_made), recorder.streams_made
