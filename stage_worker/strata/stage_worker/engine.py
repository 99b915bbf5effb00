"""One pipeline step on this stage: every active slot's chunk in one batch through the layer slice.

Continuous batching happens here: the coordinator puts a chunk per active slot into each step (a decode step is one
position, a prefill chunk many), the projections and feed-forwards run once over all rows, and attention runs per
slot over that slot's cells of the KV pool. The first stage embeds token ids; the last applies the head and samples.
A step is validated whole before it touches the pool, so a bad chunk changes nothing. A step of decode chunks only (one
position per slot) takes the batched path in strata.stage_worker.decode, captured in CUDA graphs on GPUs.

Speculative decoding: a chunk may end in `drafted` positions whose tokens the coordinator guessed. Every stage
computes them like any other positions, the last verifies them (strata.stage_worker.picks), and a step of a few
positions a slot runs as a decode step (strata.stage_worker.wide_step). The KV of the rejected positions stays behind
in the slot until the next step, which starts after the accepted ones and truncates the slot there, as every step
does.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace

import torch
from strata.stage_worker.decode import Decoder, Picks
from strata.stage_worker.decode_ahead import Ahead, rows_served, takes_ahead
from strata.stage_worker.errors import ContextExceededError, InvalidRequestError, PoolExhaustedError
from strata.stage_worker.kv_cells import Piece
from strata.stage_worker.kv_pool import KVPool
from strata.stage_worker.model import StageModel, step_layout
from strata.stage_worker.picks import pick
from strata.stage_worker.sampling import Sampled, Sampling
from strata.stage_worker.warm_steps import warm_prefill, warm_reads, warm_steps
from strata.stage_worker.wide_step import WideStep, widen
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
    drafted: int = 0  # the last `drafted` token ids are a draft to verify (speculative decoding)
    draft_allowed: tuple[bytes, ...] = ()  # under a grammar: the mask of the pick after each drafted position


@dataclass(frozen=True)
class StepResult:
    hidden: Tensor | None  # [N, D] for the next stage; None on the last stage
    tokens: dict[int, Sampled]  # slot -> sampled token (last stage), for chunks without drafted positions
    logits: dict[int, Tensor]  # slot -> [length, vocab] (last stage, when asked)
    runs: dict[int, tuple[Sampled, ...]] = field(default_factory=dict)  # slot -> accepted drafts + one pick (last)


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
        decode_ahead: bool | None = None,  # strata.stage_worker.decode_ahead; None: with CUDA graphs, where it can
    ) -> None:
        c = model.config
        sliding = tuple(c.is_sliding(il) for il in range(model.layer_start, model.layer_end))
        if pool.window is not None and (pool.windowed != sliding or pool.window.window != c.sliding_window):
            raise ValueError(
                f"the KV pool keeps a {pool.window.window}-token window on layers {pool.windowed}; the model's "
                f"sliding layers are {sliding} with a window of {c.sliding_window}"
            )
        self.model = model
        self.pool = pool
        self.device = device
        self.dtype = dtype
        self.rope = model.rope(device=device)
        if c.n_expert and (cuda_graphs or compiled):
            # On an H200 the compiled, captured decode step of a generated qwen3moe model picked other tokens than the
            # same step run eagerly from the second decoded token on; until that is understood, experts decode eagerly.
            raise ValueError("a mixture-of-experts stage decodes eagerly: CUDA graphs and compiled blocks are off")
        graphs = device.type == "cuda" and not c.n_expert if cuda_graphs is None else cuda_graphs
        self.decoder = Decoder(
            model=model,
            pool=pool,
            rope=self.rope,
            dtype=dtype,
            graphs=graphs,
            compiled=graphs if compiled is None else compiled,
        )
        possible = model.is_first and model.is_last and pool.window is None
        if decode_ahead and not possible:
            raise ValueError(
                "decoding ahead needs a stage that holds both the embedding and the head, and a pool without a "
                "sliding-window space (strata.stage_worker.decode_ahead)"
            )
        self.decodes_ahead = possible and (graphs if decode_ahead is None else decode_ahead)
        self._ahead: Ahead | None = None

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run the decode step (on GPUs: compile and capture it) for the shapes of strata.stage_worker.warm_steps
        before the stage says it is ready, so no request waits for a compiler and no broken path serves. Under
        inference mode, as `step` runs: compiled code is kept by the grad mode it was made in, so a warm-up with
        grad enabled left every step shape first met while serving to compile its blocks again. Then a prefill step
        of each attention variant the decode steps did not meet, and the long prompts' K/V read-back."""
        with on_device(self.device):
            met = warm_steps(decoder=self.decoder, pool=self.pool, model=self.model, dtype=self.dtype)
            warm_prefill(
                forward=self._forward_in_parts, pool=self.pool, model=self.model, device=self.device, dtype=self.dtype,
                met=met,
            )  # fmt: skip
            warm_reads(self.pool)

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
            strange = [t for t in chunk.sampling.penalized if not 0 <= t < vocab]
            if strange or chunk.sampling.repetition_penalty <= 0:
                raise InvalidRequestError(
                    f"slot {chunk.slot}: a repetition penalty is positive and over tokens of the vocabulary, not "
                    f"{chunk.sampling.repetition_penalty} over {strange[:5]}"
                )
            self._validate_draft(chunk)
            mask_words = (self.model.config.vocab_size + 31) // 32
            longest = max(len(mask) for mask in (chunk.sampling.allowed, *chunk.draft_allowed))
            if longest > 4 * mask_words:
                raise InvalidRequestError(
                    f"slot {chunk.slot}: an allowed-token mask over {self.model.config.vocab_size} tokens is at most "
                    f"{4 * mask_words} bytes, got {longest}"
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

    @staticmethod
    def _validate_draft(chunk: Chunk) -> None:
        if not chunk.drafted:
            if chunk.draft_allowed:
                raise InvalidRequestError(
                    f"slot {chunk.slot}: {len(chunk.draft_allowed)} draft_allowed_tokens for a chunk without drafted "
                    "positions: they are the masks of the picks after drafted positions"
                )
            return
        if not 0 < chunk.drafted < chunk.length or len(chunk.token_ids) != chunk.length:
            raise InvalidRequestError(
                f"slot {chunk.slot}: a chunk of {chunk.length} positions ends in {chunk.drafted} drafted ones only "
                f"with a position before them and all {chunk.length} token ids (got {len(chunk.token_ids)})"
            )
        s = chunk.sampling
        if not chunk.sample or chunk.return_logits or s.penalized:
            raise InvalidRequestError(
                f"slot {chunk.slot}: drafted positions are verified by the picks after them alone: a drafted chunk "
                "samples and returns no logits, with no repetition penalty (it counts the tokens picked before each "
                "position)"
            )
        if (s.allowed or chunk.draft_allowed) and (not s.allowed or len(chunk.draft_allowed) != chunk.drafted):
            raise InvalidRequestError(
                f"slot {chunk.slot}: under a grammar, each pick of a drafted chunk has its own mask: allowed_tokens "
                f"for the first and draft_allowed_tokens for the {chunk.drafted} after the drafted positions, got "
                f"{'one' if s.allowed else 'no'} allowed_tokens and {len(chunk.draft_allowed)} draft_allowed_tokens"
            )

    @torch.inference_mode()
    def step(self, chunks: list[Chunk], hidden: Tensor | None) -> StepResult:
        self.validate(chunks, hidden)
        with on_device(self.device):
            return self._step(chunks, hidden)

    def _step(self, chunks: list[Chunk], hidden: Tensor | None) -> StepResult:
        if all(chunk.length == 1 and not chunk.return_logits for chunk in chunks):
            return self._decode(chunks, hidden)
        self._forget_ahead()
        wide = widen(chunks)
        if wide is not None:
            done = self._wide(chunks, hidden, wide)
            if done is not None:
                return done
        for chunk in chunks:
            self.pool.truncate(slot=chunk.slot, position=chunk.start_position)
        if hidden is None:
            tokens = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long, device=self.device)
            x = self.model.embed(tokens)  # [N, D]
        else:
            x = hidden.to(device=self.device, dtype=self.dtype)  # [N, D]
        x = self._forward_in_parts([(c.slot, c.start_position, c.length) for c in chunks], x)  # [N, D]
        if not self.model.is_last:
            return StepResult(hidden=x, tokens={}, logits={})
        logits: dict[int, Tensor] = {}
        ends, row = [], 0
        for chunk in chunks:
            row += chunk.length
            ends.append(row)
            if chunk.return_logits:
                logits[chunk.slot] = self.model.head(x[row - chunk.length : row]).float()  # [length, vocab]
        # Each sampled chunk's last drafted + 1 rows (its last row, without drafts), in order.
        chosen: list[int] = []
        rows = []
        for chunk, end in zip(chunks, ends, strict=True):
            if chunk.sample:
                rows.append((chunk, list(range(len(chosen), len(chosen) + chunk.drafted + 1))))
                chosen.extend(range(end - 1 - chunk.drafted, end))
        if not rows:
            return StepResult(hidden=None, tokens={}, logits=logits)
        single, runs = pick(rows, self.model.head(x[chosen]))
        return StepResult(hidden=None, tokens=single, logits=logits, runs=runs)

    def _wide(self, chunks: list[Chunk], hidden: Tensor | None, wide: WideStep) -> StepResult | None:
        """A few positions a slot as one decode step (strata.stage_worker.wide_step); None where the pool cannot
        give the fillers cells now, and the step runs as any other."""
        try:
            cells = [cell for run in self.pool.take_runs(wide.pieces) for cell in run]
        except (ContextExceededError, PoolExhaustedError):
            return None
        if hidden is not None:
            hidden = hidden.to(device=self.device, dtype=self.dtype)[self._index(wide.source)]
        out = self.decoder.run(
            slots=wide.slots,
            positions=wide.positions,
            cells=cells,
            tokens=wide.tokens if self.model.is_first else [],
            hidden=hidden,
            width=wide.width,
        )
        for slot, position in wide.fillers:
            self.pool.truncate(slot=slot, position=position)
        if out.hidden is not None:
            return StepResult(hidden=out.hidden[self._index(wide.real)], tokens={}, logits={})
        if out.logits is None:
            raise RuntimeError("the last stage's decode body returned no logits")
        greedy = self.decoder.picks(out).read()
        single, runs = pick([(c, rows) for c, rows in zip(chunks, wide.picks, strict=True) if rows], out.logits,
                            greedy=greedy)  # fmt: skip
        return StepResult(hidden=None, tokens=single, logits={}, runs=runs)

    def _index(self, rows: list[int]) -> Tensor:
        return torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)

    def _forward_in_parts(self, pieces: list[Piece], x: Tensor) -> Tensor:
        """The step's rows through the layers, in as many parts as the sliding-window blocks need: each part takes
        no more new positions than that space can give now (KVPool.fit), and a part's dead blocks make room for the
        next. Parts keep the rows' order (a chunk split between two continues in the second), so the result is the
        step's, computed as if the coordinator had sent smaller chunks."""
        queue = list(pieces)
        out: list[Tensor] = []
        row = 0
        while queue:
            part = self.pool.fit(queue)
            if not part:
                raise PoolExhaustedError(f"no sliding-window KV block is free for slot {queue[0][0]}")
            slot, start, taken = part[-1]
            wanted = queue[len(part) - 1][2]
            queue = queue[len(part) :]
            if taken < wanted:
                queue.insert(0, (slot, start + taken, wanted - taken))
            rows = sum(length for _, _, length in part)
            out.append(self._forward(part, x[row : row + rows]))
            row += rows
        return out[0] if len(out) == 1 else torch.cat(out)

    def _forward(self, part: list[Piece], x: Tensor) -> Tensor:
        """One part of a step: take its cells, then run its rows [N, D] through the layers."""
        extensions = self.pool.extend_part(part)
        at = torch.cat([torch.arange(start, start + length) for _, start, length in part]).to(self.device)

        full = step_layout(
            positions=at, write_cells=torch.cat([e.full.new for e in extensions]), chunks=part, table=self.pool.table
        )
        if self.pool.window is not None:
            cells = torch.cat([e.window.new for e in extensions if e.window is not None])
            full = replace(full, window=replace(full, write_cells=cells, table=self.pool.window.table, fresh=None))
        out: Tensor = self.model(x, rope=self.rope, caches=self.pool.layers, layout=full)
        return out

    def _decode(self, chunks: list[Chunk], hidden: Tensor | None) -> StepResult:
        """One new position per slot, batched (and on CUDA replayed from a graph); greedy picks come back at once.
        Where it can, the step was launched ahead by the previous one, and this one launches the next."""
        ahead = self._ahead
        rows = None if ahead is None else rows_served(ahead, chunks, revisions=self.pool.revisions)
        if ahead is not None and rows is not None:
            picks = ahead.picks
            self._forget_ahead(keep={chunk.slot for chunk in chunks})
        else:
            self._forget_ahead()
            for chunk in chunks:
                self.pool.truncate(slot=chunk.slot, position=chunk.start_position)
            cells = self.pool.take_all([(chunk.slot, chunk.start_position) for chunk in chunks])
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
            if any(chunk.sample and not chunk.sampling.greedy_as_is for chunk in chunks):
                # the slots that sample, bias, mask or ask for log-probabilities: together, in one pass
                return self._drawn(chunks, out.logits, self.decoder.picks(out))
            picks, rows = self.decoder.picks(out), list(range(len(chunks)))
        launched = self._launch_ahead(chunks, picks, rows) if self.decodes_ahead else None
        tokens, logprobs = picks.read()
        sampled = {
            chunk.slot: Sampled(token_id=int(tokens[row]), logprob=logprobs[row], top_logprobs=())
            for chunk, row in zip(chunks, rows, strict=True)
            if chunk.sample
        }
        if launched is not None:
            self._ahead = Ahead(
                slots=tuple(chunk.slot for chunk in chunks),
                positions=tuple(chunk.start_position + 1 for chunk in chunks),
                tokens=tuple(sampled[chunk.slot].token_id for chunk in chunks),
                picks=launched,
                revisions=tuple(self.pool.revisions[chunk.slot] for chunk in chunks),
            )
        return StepResult(hidden=None, tokens=sampled, logits={})

    def _forget_ahead(self, *, keep: frozenset[int] | set[int] = frozenset()) -> None:
        """Drop the step launched ahead, giving back the position it took in each slot not in `keep` and not changed
        since (a changed slot's positions are another request's now)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        for slot, position, revision in zip(ahead.slots, ahead.positions, ahead.revisions, strict=True):
            if slot not in keep and self.pool.revisions[slot] == revision:
                self.pool.truncate(slot=slot, position=position)

    def _drawn(self, chunks: list[Chunk], logits: Tensor, picks: Picks) -> StepResult:
        """The step's picks: the greedy ones from the decode body, the others drawn from its logits."""
        rows = [(chunk, [i]) for i, chunk in enumerate(chunks) if chunk.sample]
        single, _ = pick(rows, logits, greedy=picks.read())
        return StepResult(hidden=None, tokens=single, logits={})

    def _launch_ahead(self, chunks: list[Chunk], picks: Picks, rows: list[int]) -> Picks | None:
        """The next step of these slots, launched before `picks` are read, its tokens taken from them on the device;
        None where it cannot be: a chunk that is not greedy as is, or no room for the next position."""
        if not all(takes_ahead(chunk) for chunk in chunks):
            return None
        positions = [(chunk.slot, chunk.start_position + 1) for chunk in chunks]
        try:
            cells = self.pool.take_all(positions)
        except (ContextExceededError, PoolExhaustedError):
            return None
        out = self.decoder.run(
            slots=[slot for slot, _ in positions],
            positions=[position for _, position in positions],
            cells=cells,
            tokens=[],
            hidden=None,
            fed=(picks, rows),
        )
        return self.decoder.picks(out)
