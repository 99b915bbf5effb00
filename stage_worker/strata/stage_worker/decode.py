"""Decode steps as one batched body, captured in CUDA graphs on GPUs.

A decode step (one new position per slot) is the hot loop of serving: it reads every weight once for a handful of
rows, and each slot's KV once, so on a GPU its time is those bytes over memory bandwidth, plus whatever the host adds.
Run eagerly from Python, a 32-layer llama issues well over a thousand kernels per token and the host's launch time,
not the memory, sets the pace. Here the whole step runs as one body whose shapes depend only on the batch size B
(attention reads each slot's exact length from a device tensor), so on CUDA it is captured once per B and replayed
at any depth: one launch per step. The inputs travel in one small host-to-device copy into static buffers;
greedy tokens and their log-probabilities come back in one device-to-host copy.

A step that verifies drafts (speculative decoding) carries a few positions a slot: the same body with `width` rows a
slot, captured once per (B, width), so verifying k drafts costs a replay too, not an eager pass through the layers.

On the CPU the same body runs eagerly, so the fidelity tests cover the batched attention too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from strata.stage_worker.kernels import dependent_launch
from strata.stage_worker.kernels.greedy_pick import greedy_pick
from strata.stage_worker.kv_pool import KVPool, Taken
from strata.stage_worker.model import RunBlock, StageModel, decode_layout, run_block, run_wide_block
from strata.stage_worker.rope import Rope
from torch import Tensor


@dataclass(frozen=True)
class DecodeOutput:
    hidden: Tensor | None  # [rows, D] for the next stage; None on the last stage
    logits: Tensor | None  # [rows, vocab] f32 (last stage)
    greedy: Tensor | None  # [2, rows] f32: argmax token and its log-probability (last stage)


@dataclass(frozen=True)
class Picks:
    """A last-stage decode step's greedy picks: on the device (where the next step may take its tokens from them)
    and on their way to the host, without waiting for the GPU until they are read."""

    device: Tensor  # [2, rows] f32
    host: Tensor  # [2, rows] f32, pinned on CUDA
    ready: torch.cuda.Event | None  # recorded after the copy; None on the CPU

    def read(self) -> tuple[list[float], list[float]]:
        """(tokens, log-probabilities), once the copy is done."""
        if self.ready is not None:
            self.ready.synchronize()
        tokens, logprobs = self.host.tolist()
        return tokens, logprobs


WIDEST = 8  # rows a slot a captured step takes at most: a step verifying up to 7 drafted positions


@dataclass(frozen=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    output: DecodeOutput


class Decoder:
    def __init__(
        self,
        *,
        model: StageModel,
        pool: KVPool,
        rope: Rope,
        dtype: torch.dtype,
        graphs: bool,
        compiled: bool = False,
        dynamic: bool = True,
    ) -> None:
        self.model = model
        self.pool = pool
        self.rope = rope
        self.device = pool.device
        self.graphs = graphs
        # torch.compile fuses a block's elementwise work (norms, RoPE, the q8_0 KV quantise and dequantise) into a
        # few generated kernels; the CUDA graph then replays those. One block is compiled and its code serves every
        # layer (the blocks differ only in their tensors), so a new (B, S) costs one block's compilation, not a
        # whole model's.
        self._run: RunBlock = run_block
        self._run_wide: RunBlock = run_block
        if compiled:
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
            self._run = torch.compile(run_block, dynamic=dynamic)
            self._run_wide = torch.compile(run_wide_block, dynamic=dynamic)
        n = pool.parallel
        # Per row: slot, position, cell, token, the cell of the sliding-window layers when they have their own, and
        # the row's column in the table attention reads (its position, or its column in the resident window's)
        self.inputs = torch.zeros(6, n * WIDEST, dtype=torch.long, device=self.device)
        self.hidden = torch.zeros(n * WIDEST, model.config.dim, dtype=dtype, device=self.device)
        self._captured: dict[tuple[int, int], _Captured] = {}  # by (slots, rows a slot)
        self._rows = torch.arange(n, dtype=torch.long, device=self.device)
        self._memory = torch.cuda.graph_pool_handle() if graphs else None
        # Warm-up and capture run on a stream of the stage's own device. torch.cuda.graph's default capture stream
        # is one per process, made on whichever device was current at the first capture: a second stage on another
        # GPU of the same process would capture on a stream of the first one's device.
        self._capture_stream = torch.cuda.Stream(self.device) if graphs else None  # type: ignore[no-untyped-call]

    @property
    def captured(self) -> int:
        return len(self._captured)

    @property
    def compiled_widths(self) -> range:
        """The rows a slot whose steps run compiled blocks: every width, or none on an uncompiled decoder."""
        return range(1, WIDEST + 1) if self._run is not run_block else range(0)

    def run(
        self,
        *,
        slots: list[int],
        positions: list[int],
        cells: list[Taken],  # per row: its new cells and its column (KVPool.take_runs)
        tokens: list[int],
        hidden: Tensor | None,
        fed: tuple[Picks, list[int]] | None = None,
        width: int = 1,
    ) -> DecodeOutput:
        """Per row: slots, positions, cells and tokens, `width` rows a slot (its consecutive positions). `fed`: take
        the tokens from an earlier step's picks (those rows of them) on the device, not from `tokens`: that step's
        picks need not have reached the host."""
        if not 1 <= width <= WIDEST or len(slots) % width:
            raise ValueError(f"a decode step takes 1..{WIDEST} rows a slot, the same for each: {len(slots)} by {width}")
        n = len(slots)
        full, window, column = zip(*cells, strict=True)
        host = torch.tensor(
            [slots, positions, list(full), tokens or [0] * n, list(window), list(column)], dtype=torch.long
        )
        self.inputs[:, :n].copy_(host, non_blocking=True)
        if fed is not None:
            picks, rows = fed
            if rows == list(range(n)):
                self.inputs[3, :n].copy_(picks.device[0, :n])
            else:
                index = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
                self.inputs[3, :n].copy_(picks.device[0].index_select(0, index))
        if hidden is not None:
            self.hidden[:n].copy_(hidden, non_blocking=True)
        key = (n // width, width)
        if not self.graphs:
            return self._body(*key)
        captured = self._captured.get(key) or self._capture(*key)
        captured.graph.replay()
        return captured.output

    def picks(self, output: DecodeOutput) -> Picks:
        """The greedy picks of a step just run, copied towards the host behind it on the stream: the next step may be
        launched before they are read. The device tensor is the step's own (a graph's static output), valid until
        the same batch size replays again."""
        if output.greedy is None:
            raise RuntimeError("only the last stage's decode step picks tokens")
        if self.device.type != "cuda":
            return Picks(device=output.greedy, host=output.greedy.clone(), ready=None)
        host = torch.empty(output.greedy.shape, dtype=output.greedy.dtype, pin_memory=True)
        host.copy_(output.greedy, non_blocking=True)
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record(torch.cuda.current_stream(self.device))
        return Picks(device=output.greedy, host=host, ready=ready)

    def _capture(self, b: int, width: int) -> _Captured:
        # Warm up on the capture stream (the step's real work; the replay repeats it exactly), then capture on it.
        # Both under the stage's device too: the kernels' launches and the graph's pool follow the current device, and
        # a stage on cuda:1 driven from a thread whose current device is cuda:0 would otherwise mix the two.
        stream = self._capture_stream
        if stream is None:
            raise RuntimeError("a decoder without CUDA graphs captured a decode step")
        with torch.cuda.device(self.device):
            current = torch.cuda.current_stream(self.device)
            stream.wait_stream(current)
            # Both runs launch the kernels a captured step does (dependent_launch: as dependents on Hopper), so the
            # warm-up compiles the variants the capture records.
            with torch.cuda.stream(stream), dependent_launch.captured_step():
                self._body(b, width)
            current.wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._memory, stream=stream), dependent_launch.captured_step():
                output = self._body(b, width)
        captured = _Captured(graph=graph, output=output)
        self._captured[(b, width)] = captured
        return captured

    def _body(self, b: int, width: int) -> DecodeOutput:
        n = b * width
        slots, positions, cells, tokens, window_cells, columns = self.inputs[:, :n]
        window, resident = self.pool.window, self.pool.resident
        layout = decode_layout(
            table=self.pool.table,
            slots=slots,
            positions=positions,
            cells=cells,
            rows=self._rows[:b],
            width=width,
            window_table=None if window is None else window.table,
            window_cells=None if window is None else window_cells,
            resident_table=None if resident is None else resident.table,
            columns=columns,
        )
        x = self.model.embed(tokens) if self.model.is_first else self.hidden[:n]  # [N, D]
        # Steps of several rows a slot run blocks compiled apart (model.run_wide_block). Uncompiled inside their graph,
        # one Gemma 3 270M slot verifying 4 drafts took 2.93 ms in process, compiled 2.25-2.30 (H200, 2026-11-28).
        run = self._run if width == 1 else self._run_wide
        x = self.model(x, rope=self.rope, caches=self.pool.layers, layout=layout, run=run)  # [N, D]
        if not self.model.is_last:
            return DecodeOutput(hidden=x, logits=None, greedy=None)
        logits = self.model.head(x).float()  # [N, vocab]
        return DecodeOutput(hidden=None, logits=logits, greedy=greedy_pick(logits))
