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

The driver asks for a proposal in a worker thread (a DraftModelDrafter `computes`), so the gateway's event loop
serves everything else while the draft runs; one lock keeps the draft's engine to one thread at a time, since the
drivers of several pipelines share it. Drafting the next run while the stages verify this one ("tail drafting") is
the next piece; until then the method pays where the draft is much cheaper than a pipeline step.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable, Sequence

import torch
from strata.gateway.draft_lengths import smoothed
from strata.gateway.speculation import DraftModelError, DraftSource, Speculation
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
        # The engine and the free slots, for one thread at a time: proposals run in worker threads, and the
        # drivers of several pipelines share this draft.
        self.lock = threading.Lock()

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


class DraftModelDrafter:
    """One request's drafter (the interface of strata.gateway.speculation.Drafter) on its slot of the draft model."""

    computes = True  # a proposal runs the draft model: the driver asks for it in a worker thread

    @property
    def token_seconds(self) -> float:
        return self._model.token_seconds

    def __init__(self, model: DraftModel, *, slot: int, prompt: Sequence[int]) -> None:
        self._model = model
        self.slot = slot
        self.tokens: list[int] = list(prompt)  # the request's: prompt, then the target's tokens
        self.held: list[int] = []  # the tokens whose positions the slot holds, in order
        self.closed = False

    def extend(self, tokens: Iterable[int]) -> None:
        self.tokens.extend(tokens)

    def propose(self, limit: int) -> tuple[int, ...]:
        """Up to `limit` (and max draft) greedy draft tokens after the request's last, stopping before the first
        under the probability floor; () when fewer than the minimum draft, or once the draft has failed."""
        s = self._model.speculation
        limit = min(limit, s.max_draft)
        if self.closed or limit < s.min_draft or not self.tokens:
            return ()
        try:
            with self._model.lock:
                draft = () if self.closed else self._guess(limit, p_min=s.p_min)
        except StageError as exc:  # the draft's own pool refused (context, window): the request goes on undrafted
            name = self._model.name
            log.warning("draft model %s failed on slot %d; its request decodes undrafted: %s", name, self.slot, exc)
            self.close()
            return ()
        return draft if len(draft) >= s.min_draft else ()

    def close(self) -> None:
        """Give the slot back (the request finished or was cancelled); a second close does nothing."""
        if not self.closed:
            self.closed = True
            self._model.release(self.slot)

    def _guess(self, limit: int, *, p_min: float) -> tuple[int, ...]:
        kept = kept_positions(self.held, self.tokens)
        pick = self._feed(kept, self.tokens[kept:])
        draft: list[int] = []
        while sure_enough(pick, p_min=p_min):
            draft.append(pick.token_id)
            if len(draft) == limit:
                break
            pick = self._feed(len(self.held), [pick.token_id])
        return tuple(draft)

    def _feed(self, start: int, tokens: Sequence[int]) -> Sampled:
        """Feed `tokens` from position `start` (the slot truncated there), in pieces; the greedy pick after them."""
        del self.held[start:]
        engine = self._model.engine
        pick: Sampled | None = None
        for at in range(0, len(tokens), PREFILL_CHUNK):
            piece = tuple(tokens[at : at + PREFILL_CHUNK])
            last = at + PREFILL_CHUNK >= len(tokens)
            begun = time.perf_counter()
            result = engine.step([Chunk(self.slot, start + at, len(piece), piece, sample=last)], None)
            if len(piece) <= TOKEN_STEP_POSITIONS:  # a decode step, not a prompt's prefill
                self._model.token_seconds = smoothed(self._model.token_seconds, time.perf_counter() - begun)
            self.held.extend(piece)
            if last:
                pick = result.tokens[self.slot]
        if pick is None:
            raise ValueError("a draft feed needs at least one token")
        return pick


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
    return DraftModel(engine=engine, speculation=speculation, name=source.url)
