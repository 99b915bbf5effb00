"""One pipeline step on this stage: every active slot's chunk in one batch through the layer slice.

Continuous batching happens here: the coordinator puts a chunk per active slot into each step (a decode step is one
position, a prefill chunk many), the projections and feed-forwards run once over all rows, and attention runs per
slot over that slot's cells of the KV pool. The first stage embeds token ids; the last applies the head and samples.
A step is validated whole before it touches the pool, so a bad chunk changes nothing. A step of decode chunks only (one
position per slot) takes the batched path in strata.stage_worker.decode, captured in CUDA graphs on GPUs.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
from strata.stage_worker.decode import Decoder
from strata.stage_worker.errors import InvalidRequestError
from strata.stage_worker.kv_pool import KVPool
from strata.stage_worker.model import ChunkView, Rope, StageModel, step_layout
from strata.stage_worker.sampling import Sampled, Sampling, sample
from torch import Tensor


def on_device(device: torch.device) -> AbstractContextManager[object]:
    """Make the stage's GPU the current one for a step: gRPC and loader threads start on cuda:0, and graph capture,
    Triton launches and new streams use the current device, not the tensors'."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


@dataclass(frozen=True)
class Chunk:
    slot: int
    start_position: int
    length: int
    token_ids: tuple[int, ...] = ()
    sample: bool = False
    sampling: Sampling = field(default_factory=Sampling)
    return_logits: bool = False


@dataclass(frozen=True)
class StepResult:
    hidden: Tensor | None  # [N, D] for the next stage; None on the last stage
    tokens: dict[int, Sampled]  # slot -> sampled token (last stage)
    logits: dict[int, Tensor]  # slot -> [length, vocab] (last stage, when asked)


class Engine:
    def __init__(
        self,
        *,
        model: StageModel,
        pool: KVPool,
        device: torch.device,
        dtype: torch.dtype,
        cuda_graphs: bool | None = None,  # None: on CUDA devices
        compiled: bool | None = None,  # torch.compile the decode step's blocks; None: with CUDA graphs
    ) -> None:
        self.model = model
        self.pool = pool
        self.device = device
        self.dtype = dtype
        self.rope = Rope(model.config, device=device)
        graphs = device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.decoder = Decoder(
            model=model,
            pool=pool,
            rope=self.rope,
            dtype=dtype,
            graphs=graphs,
            compiled=graphs if compiled is None else compiled,
        )

    def warm_up(self) -> None:
        """Run the decode step (on GPUs: compile and capture it) for one slot and for several before the stage says
        it is ready, so no request waits for it and no broken path serves (dynamic shapes: these two cover every
        batch size and depth)."""
        with on_device(self.device):
            self._warm_up()

    def _warm_up(self) -> None:
        for batch in sorted({1, min(2, self.pool.parallel)}):
            slots = list(range(batch))
            hidden = (
                None
                if self.model.is_first
                else torch.zeros(batch, self.model.config.dim, dtype=self.dtype, device=self.device)
            )
            try:
                cells = [self.pool.take(slot=slot, position=0) for slot in slots]
                self.decoder.run(slots=slots, positions=[0] * batch, cells=cells, tokens=[0] * batch, hidden=hidden)
            finally:  # a failed compilation leaves the slots empty too, for the engine that replaces this one
                for slot in slots:
                    self.pool.reset(slot)

    def validate(self, chunks: list[Chunk], hidden: Tensor | None) -> None:
        if not chunks:
            raise InvalidRequestError("a step needs at least one chunk")
        slots = [chunk.slot for chunk in chunks]
        if len(set(slots)) != len(slots):
            raise InvalidRequestError(f"a step names a slot more than once: {slots}")
        total = 0
        for chunk in chunks:
            if chunk.length < 1:
                raise InvalidRequestError(f"the chunk for slot {chunk.slot} has no positions")
            self.pool.check(slot=chunk.slot, start_position=chunk.start_position, length=chunk.length)
            total += chunk.length
            vocab = self.model.config.vocab_size
            outside = [t for t, _ in chunk.sampling.logit_bias if not 0 <= t < vocab]
            if outside:
                raise InvalidRequestError(
                    f"slot {chunk.slot}: logit bias for tokens {outside[:5]} outside the vocabulary"
                )
            mask_words = (self.model.config.vocab_size + 31) // 32
            if len(chunk.sampling.allowed) > 4 * mask_words:
                raise InvalidRequestError(
                    f"slot {chunk.slot}: an allowed-token mask over {self.model.config.vocab_size} tokens is at most "
                    f"{4 * mask_words} bytes, got {len(chunk.sampling.allowed)}"
                )
            if self.model.is_first:
                if len(chunk.token_ids) != chunk.length:
                    raise InvalidRequestError(
                        f"slot {chunk.slot}: the first stage needs {chunk.length} token ids, got {len(chunk.token_ids)}"
                    )
                bad = [t for t in chunk.token_ids if not 0 <= t < self.model.config.vocab_size]
                if bad:
                    raise InvalidRequestError(f"slot {chunk.slot}: token ids {bad[:5]} are outside the vocabulary")
        if self.model.is_first:
            return
        dim = self.model.config.dim
        if hidden is None or hidden.dim() != 2 or hidden.shape[1] != dim or hidden.shape[0] != total:
            shape = None if hidden is None else tuple(hidden.shape)
            raise InvalidRequestError(f"hidden states must be [{total}, {dim}] for this step, got {shape}")

    @torch.inference_mode()
    def step(self, chunks: list[Chunk], hidden: Tensor | None) -> StepResult:
        self.validate(chunks, hidden)
        with on_device(self.device):
            return self._step(chunks, hidden)

    def _step(self, chunks: list[Chunk], hidden: Tensor | None) -> StepResult:
        if all(chunk.length == 1 and not chunk.return_logits for chunk in chunks):
            return self._decode(chunks, hidden)
        positions: list[Tensor] = []
        writes: list[Tensor] = []
        views: list[ChunkView] = []
        row = 0
        for chunk in chunks:
            new_cells, all_cells = self.pool.extend(
                slot=chunk.slot, start_position=chunk.start_position, length=chunk.length
            )
            positions.append(torch.arange(chunk.start_position, chunk.start_position + chunk.length))
            writes.append(new_cells)
            views.append(
                ChunkView(
                    rows=slice(row, row + chunk.length),
                    slot=chunk.slot,
                    start_position=chunk.start_position,
                    cells=all_cells,
                )
            )
            row += chunk.length
        layout = step_layout(
            positions=torch.cat(positions).to(self.device),
            write_cells=torch.cat(writes),
            chunks=tuple(views),
            table=self.pool.table,
        )
        if hidden is None:
            tokens = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long, device=self.device)
            x = self.model.embed(tokens)  # [N, D]
        else:
            x = hidden.to(device=self.device, dtype=self.dtype)  # [N, D]
        x = self.model(x, rope=self.rope, caches=self.pool.layers, layout=layout)  # [N, D]
        if not self.model.is_last:
            return StepResult(hidden=x, tokens={}, logits={})
        sampled: dict[int, Sampled] = {}
        logits: dict[int, Tensor] = {}
        for chunk, view in zip(chunks, views, strict=True):
            if chunk.return_logits:
                logits[chunk.slot] = self.model.head(x[view.rows]).float()  # [length, vocab]
            if chunk.sample:
                last = logits[chunk.slot][-1] if chunk.return_logits else self.model.head(x[view.rows][-1:])[0]
                end = chunk.start_position + chunk.length
                sampled[chunk.slot] = sample(last, params=chunk.sampling, position=end)
        return StepResult(hidden=None, tokens=sampled, logits=logits)

    def _decode(self, chunks: list[Chunk], hidden: Tensor | None) -> StepResult:
        """One new position per slot, batched (and on CUDA replayed from a graph); greedy picks come back at once."""
        cells = [self.pool.take(slot=chunk.slot, position=chunk.start_position) for chunk in chunks]
        out = self.decoder.run(
            slots=[chunk.slot for chunk in chunks],
            positions=[chunk.start_position for chunk in chunks],
            cells=cells,
            tokens=[chunk.token_ids[0] for chunk in chunks] if self.model.is_first else [],
            hidden=None if hidden is None else hidden.to(device=self.device, dtype=self.dtype),
        )
        if out.hidden is not None:
            return StepResult(hidden=out.hidden.clone(), tokens={}, logits={})
        if out.logits is None or out.greedy is None:
            raise RuntimeError("the last stage's decode body returned no logits")
        tokens, logprobs = out.greedy.cpu().tolist()
        sampled: dict[int, Sampled] = {}
        for i, chunk in enumerate(chunks):
            if not chunk.sample:
                continue
            if chunk.sampling.greedy_as_is:
                sampled[chunk.slot] = Sampled(token_id=int(tokens[i]), logprob=logprobs[i], top_logprobs=())
            else:
                sampled[chunk.slot] = sample(out.logits[i], params=chunk.sampling, position=chunk.start_position + 1)
        return StepResult(hidden=None, tokens=sampled, logits={})
