"""Speculative decoding's draft-model method: a small GGUF of the target's vocabulary guesses the next tokens.

n-gram lookup (strata.gateway.speculation) proposes only what the context repeats; a small model of the target's
family agrees with it on much of ordinary text too. The draft runs in the gateway process through the stage
worker's own engine (strata.stage_worker.engine): one stage holding every layer of the draft, with a KV pool of its
own, a slot for each request that drafts. Its guesses are greedy, its own argmax run, and they stop early at the
first pick whose probability is under the floor `p_min`: past an unlikely token the rest is likely wasted.

The draft's KV follows the request's tokens. A drafter knows the request's tokens (the prompt, then each token the
target produced) and the tokens its slot holds positions for (what it fed, its own rejected guesses included).
Before a proposal it feeds, from the first position where the two differ, the request's tokens that the slot does
not hold, as one chunk starting at that position: the engine truncates the slot there, as every stage does, so a
rejected guess leaves nothing behind. The prompt is prefilled once, with the first proposal. Each decode step then
costs the draft the accepted run plus one position for each further guess.

Refused at start-up, naming both files: a draft whose vocabulary differs from the target's in size or in any
token's text, since its token ids would mean other text than the target's.

The driver asks for a step's proposals in one worker thread (a DraftModelDrafter `computes`), so the gateway's event
loop serves everything else while the draft runs; one lock keeps the draft's engine to one thread at a time, since the
drivers of several pipelines share it. The lanes of a step propose together (DraftModel.propose): one engine step
feeds every lane what its slot lacks, then one step a draft token carries every lane still drafting, so a full batch
drafts in about as many draft steps as one lane does, where one lane after another took a step a lane and token.
Drafting the next run while the stages verify this one ("tail drafting") is the next piece; until then the method
pays where the draft is much cheaper than a pipeline step.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable, Sequence

import torch
from strata.gateway.draft_lengths import smoothed
from strata.gateway.speculation import Drafter, DraftModelError, DraftSource, Speculation
from strata.gguf import read_model_header
from strata.gguf.errors import GGUFError
from strata.gguf.header import GGUFHeader
from strata.gguf.sources import open_source
from strata.stage_worker.engine import Chunk, Engine
from strata.stage_worker.errors import StageError
from strata.stage_worker.loader import LoadProgress, config_from_header, load_stage
from strata.stage_worker.sampling import Sampled
from strata.stage_worker.settings import default_dtype
from strata.stage_worker.stage_load import stage_pool
from strata.stage_worker.warm_up import warm_engine

log = logging.getLogger(__name__)

PREFILL_CHUNK = 512  # positions a draft prefill step takes at most, so a long prompt never makes one huge batch
TOKEN_STEP_POSITIONS = 17  # a feed of at most this many positions (an accepted run and a pick) times a draft token
TIMED_FEED = 128  # positions of the feed timed at load


def vocabulary_refusal(*, target: GGUFHeader, draft: GGUFHeader, target_name: str, draft_name: str) -> str | None:
    """Why the draft's token ids would not mean the target's text (None when they do): a vocabulary of another
    size, or a token whose text differs."""
    target_tokens = target.metadata.get("tokenizer.ggml.tokens")
    draft_tokens = draft.metadata.get("tokenizer.ggml.tokens")
    if not isinstance(draft_tokens, tuple) or not isinstance(target_tokens, tuple):
        missing = draft_name if not isinstance(draft_tokens, tuple) else target_name
        return f"{missing} has no tokenizer tokens, so draft {draft_name} cannot be checked against {target_name}"
    sizes = (config_from_header(target).vocab_size, config_from_header(draft).vocab_size)
    if len(draft_tokens) != len(target_tokens) or sizes[0] != sizes[1]:
        return (
            f"draft {draft_name} has a vocabulary of {len(draft_tokens)} tokens ({sizes[1]} logits) and target "
            f"{target_name} one of {len(target_tokens)} ({sizes[0]} logits): a draft must share the target's vocabulary"
        )
    for index, (mine, theirs) in enumerate(zip(draft_tokens, target_tokens, strict=True)):
        if mine != theirs:
            return (
                f"token {index} is {mine!r} in draft {draft_name} and {theirs!r} in target {target_name}: a draft "
                "must share the target's vocabulary"
            )
    return None


def kept_positions(held: Sequence[int], tokens: Sequence[int]) -> int:
    """How many of the slot's positions (`held`) stay before the request's `tokens` are fed: those up to the first
    difference, and never all of `tokens`, since the pick after the last token needs that token fed again."""
    limit = min(len(held), len(tokens) - 1)
    kept = 0
    while kept < limit and held[kept] == tokens[kept]:
        kept += 1
    return kept


def sure_enough(pick: Sampled, *, p_min: float) -> bool:
    """Whether a draft pick goes into the proposal: its probability (under the draft) is at least the floor."""
    return math.exp(pick.logprob) >= p_min


class DraftModel:
    """One draft engine shared by the gateway's requests; a request drafts while it holds one of its KV slots."""

    def __init__(self, *, engine: Engine, speculation: Speculation, name: str) -> None:
        self.engine = engine
        self.speculation = speculation
        self.name = name
        self._free = list(range(engine.pool.parallel - 1, -1, -1))  # popped from the end: slot 0 first
        self._short = False  # a request went without a draft slot since one was last free (warned once)
        # Seconds a draft step of a few positions takes, lately (0 until one ran): what a draft token costs, which
        # the driver weighs against what it saves (strata.gateway.draft_lengths).
        self.token_seconds = 0.0
        # Seconds a feed of a prompt takes a position, lately: what a lane's first proposal costs before its first
        # draft token (its slot fed the prompt), which the driver weighs too.
        self.feed_seconds = 0.0
        # The engine and the free slots, for one thread at a time: proposals run in worker threads, and the
        # drivers of several pipelines share this draft.
        self.lock = threading.Lock()

    def time_steps(self) -> None:
        """Time a feed of a prompt and a draft token on slot 0, so that the first proposals are priced by measure,
        never taken as free. Each runs twice and the second is kept: a GPU may compile a shape on its first use."""
        prompt = tuple(range(min(TIMED_FEED, self.engine.pool.context - 1)))  # any ids of the vocabulary do
        for _ in range(2):
            self.engine.pool.reset(0)
            begun = time.perf_counter()
            fed = self.engine.step([Chunk(0, 0, len(prompt), prompt, sample=True)], None)
            middle = time.perf_counter()
            self.engine.step([Chunk(0, len(prompt), 1, (fed.tokens[0].token_id,), sample=True)], None)
            ended = time.perf_counter()
        self.engine.pool.reset(0)
        self.feed_seconds, self.token_seconds = (middle - begun) / len(prompt), ended - middle

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def drafter(self, prompt: Sequence[int]) -> DraftModelDrafter | None:
        """A drafter on a free slot; None when every slot drafts for a request (this one then decodes without)."""
        with self.lock:
            slot = self._free.pop() if self._free else None
        if slot is None:
            if not self._short:
                log.warning(
                    "all %d slots of draft model %s are in use: new requests decode without drafts until one frees",
                    self.engine.pool.parallel,
                    self.name,
                )
            self._short = True
            return None
        self._short = False
        return DraftModelDrafter(self, slot=slot, prompt=prompt)

    def release(self, slot: int) -> None:
        """Reset the slot and free it; waits for a proposal running on it in a worker thread to end first."""
        with self.lock:
            self.engine.pool.reset(slot)
            self._free.append(slot)

    def propose(self, lanes: Sequence[tuple[Drafter, int]]) -> list[tuple[int, ...]]:
        """Each lane's draft: up to its `limit` (and max draft) greedy tokens after its request's last, stopping
        before the first under the probability floor; () when fewer than the minimum draft, or once its drafter has
        failed. All lanes step together: one engine step feeds every lane what its slot lacks, then one step a draft
        token carries every lane still drafting. A step that fails fails all its lanes, so each is tried again alone:
        the one at fault goes on undrafted (its drafter closed), the others keep their drafts."""
        s = self.speculation
        mine = [(self._own(drafter), min(limit, s.max_draft)) for drafter, limit in lanes]
        going = [(d, limit) for d, limit in mine if limit >= s.min_draft and d.tokens]
        drafts: dict[int, tuple[int, ...]] = {}
        try:
            with self.lock:
                going = [(d, limit) for d, limit in going if not d.closed]  # a close waits for the lock
                drafts = dict(zip((id(d) for d, _ in going), self._guess(going, p_min=s.p_min), strict=True))
        except StageError as exc:  # the draft's own pool refused (context, window)
            if len(going) > 1:
                return [self.propose([lane])[0] for lane in lanes]
            d = going[0][0]
            log.warning("draft model %s failed on slot %d; its request decodes undrafted: %s", self.name, d.slot, exc)
            d.close()
        return [draft if len(draft := drafts.get(id(d), ())) >= s.min_draft else () for d, _ in mine]

    def _own(self, drafter: Drafter) -> DraftModelDrafter:
        if not isinstance(drafter, DraftModelDrafter) or drafter.shared is not self:
            raise TypeError(f"draft model {self.name} proposes for its own drafters only, not {drafter!r}")
        return drafter

    def _guess(self, lanes: list[tuple[DraftModelDrafter, int]], *, p_min: float) -> list[tuple[int, ...]]:
        """The lanes' greedy runs (see `propose`), every lane's slot fed first from where it differs from its
        request's tokens (the engine truncates the slot there, so a rejected guess leaves nothing behind)."""
        feeds = []
        for d, _ in lanes:
            kept = kept_positions(d.held, d.tokens)
            del d.held[kept:]
            feeds.append((d, d.tokens[kept:]))
        picks: dict[int, Sampled] = {}
        for at in range(0, max((len(tokens) for _, tokens in feeds), default=0), PREFILL_CHUNK):
            fed = [(d, tuple(tokens[at : at + PREFILL_CHUNK])) for d, tokens in feeds if at < len(tokens)]
            last = {id(d) for d, tokens in feeds if at < len(tokens) <= at + PREFILL_CHUNK}
            picks |= self._step([(d, piece, id(d) in last) for d, piece in fed])
        drafts: dict[int, list[int]] = {id(d): [] for d, _ in lanes}
        drafting = list(lanes)
        while drafting:
            going = []
            for d, limit in drafting:
                pick = picks[id(d)]
                if sure_enough(pick, p_min=p_min):
                    drafts[id(d)].append(pick.token_id)
                    if len(drafts[id(d)]) < limit:
                        going.append((d, limit))
            if going:
                picks |= self._step([(d, (picks[id(d)].token_id,), True) for d, _ in going])
            drafting = going
        return [tuple(drafts[id(d)]) for d, _ in lanes]

    def _step(self, pieces: list[tuple[DraftModelDrafter, tuple[int, ...], bool]]) -> dict[int, Sampled]:
        """One engine step of each drafter's piece after what its slot holds (sampled where asked): the picks by
        drafter. A step of decode-sized pieces times what a draft token costs a lane: the step over its lanes."""
        chunks = [Chunk(d.slot, len(d.held), len(piece), piece, sample=sample) for d, piece, sample in pieces]
        begun = time.perf_counter()
        result = self.engine.step(chunks, None)
        seconds = time.perf_counter() - begun
        if all(len(piece) <= TOKEN_STEP_POSITIONS for _, piece, _ in pieces):  # decode steps, not a prompt's prefill
            self.token_seconds = smoothed(self.token_seconds, seconds / len(pieces))
        else:
            self.feed_seconds = smoothed(self.feed_seconds, seconds / sum(len(piece) for _, piece, _ in pieces))
        for d, piece, _ in pieces:
            d.held.extend(piece)
        return {id(d): result.tokens[d.slot] for d, _, sample in pieces if sample}


class DraftModelDrafter:
    """One request's drafter (the interface of strata.gateway.speculation.Drafter) on its slot of the draft model."""

    computes = True  # a proposal runs the draft model: the driver asks for it in a worker thread

    @property
    def token_seconds(self) -> float:
        return self._model.token_seconds

    @property
    def start_seconds(self) -> float:
        """The feed of what came since the slot's last one, where that is more than a decode step's feed (the
        prompt, at the first proposal). Counted from the ends of the two lists: a rejected guess the slot holds
        makes it a few positions short, which only a feed a decode step takes anyway would notice."""
        unfed = len(self.tokens) - len(self.held)
        return unfed * self._model.feed_seconds if unfed > TOKEN_STEP_POSITIONS else 0.0

    def __init__(self, model: DraftModel, *, slot: int, prompt: Sequence[int]) -> None:
        self._model = model
        self.slot = slot
        self.tokens: list[int] = list(prompt)  # the request's: prompt, then the target's tokens
        self.held: list[int] = []  # the tokens whose positions the slot holds, in order
        self.closed = False

    def extend(self, tokens: Iterable[int]) -> None:
        self.tokens.extend(tokens)

    @property
    def shared(self) -> DraftModel:
        return self._model

    def propose(self, limit: int) -> tuple[int, ...]:
        """This request's draft alone (DraftModel.propose)."""
        return self._model.propose([(self, limit)])[0]

    def close(self) -> None:
        """Give the slot back (the request finished or was cancelled); a second close does nothing."""
        if not self.closed:
            self.closed = True
            self._model.release(self.slot)


def load_draft_model(
    source: DraftSource, *, target: GGUFHeader, target_url: str, speculation: Speculation, context: int, slots: int
) -> DraftModel:
    """The draft at `source`, checked against the target's header before its weights are read, on one stage of
    all its layers with a KV pool of `context` cells over `slots` slots, warmed up."""
    try:
        header, _size = read_model_header(source.url, token=source.token)
        refusal = vocabulary_refusal(target=target, draft=header, target_name=target_url, draft_name=source.url)
        if refusal is not None:
            raise DraftModelError(refusal)
        return _load(source, header=header, speculation=speculation, context=context, slots=slots)
    except (GGUFError, StageError) as exc:
        raise DraftModelError(f"draft model {source.url} cannot draft for {target_url}: {exc}") from exc


def _load(source: DraftSource, *, header: GGUFHeader, speculation: Speculation, context: int, slots: int) -> DraftModel:
    config = config_from_header(header)
    device = torch.device(source.device)
    dtype = default_dtype(device)
    with open_source(source.url, token=source.token) as byte_source:
        model = load_stage(
            source=byte_source,
            header=header,
            layer_start=0,
            layer_end=config.n_layer,
            dtype=dtype,
            device=device,
            progress=LoadProgress(),
        )
    pool = stage_pool(
        config,
        layers=range(config.n_layer),
        context=context,
        parallel=slots,
        cache_types=(source.cache_type, source.cache_type),
        dtype=dtype,
        device=device,
    )
    engine = warm_engine(model=model, pool=pool, device=device, dtype=dtype, stage_index=0)
    draft = DraftModel(engine=engine, speculation=speculation, name=source.url)
    draft.time_steps()
    return draft
