"""The draft-model method through the coordinator's driver on real stage servers: the same greedy tokens with a draft
model as without speculation, on 1, 2 and 3 stages, with the target as its own draft (nearly every guess accepted) and
with another generated model of the same vocabulary; the draft's slot freed when a request ends or is cancelled;
a draft of another vocabulary refused, naming both files."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import pytest
from strata.gateway.draft_model import (
    DraftModel,
    DraftModelDrafter,
    kept_positions,
    load_draft_model,
    vocabulary_refusal,
)
from strata.gateway.generation import Finished, Sampling, Token
from strata.gateway.metrics import GatewayMetrics
from strata.gateway.pipeline import Pipeline
from strata.gateway.speculation import Drafter, DraftModelError, DraftSource, Speculation, proposals
from strata.gguf import read_model_header
from strata.gguf.header import GGUFHeader
from strata.gguf.model import CacheType
from strata.gguf.testmodels import SMALL_SHAPES, write_test_model
from strata.lease import FencingToken
from strata_testbed.pipelines import local_pipeline

SPANS = {1: [(0, 4)], 2: [(0, 2), (2, 4)], 3: [(0, 1), (1, 3), (3, 4)]}
FENCE = FencingToken(lease_uid="lease", term=1, holder="draft-model-test")
PROMPT = (*range(30, 50), 7, 8, *range(60, 70))
NEW_TOKENS = 20
CONTEXT = 256
# A generated model's logits are nearly flat, so no pick is likely: the floor is off here and tested on its own.
SPECULATION = Speculation(p_min=0.0)
GREEDY = Sampling()
# Low enough that the generated model's flat logits still give text a draft can guess now and then.
SAMPLED = Sampling(temperature=0.05, seed=3)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("draft-model")
    other_vocabulary = dataclasses.replace(SMALL_SHAPES["llama"], vocab_size=1200)
    return {
        "target": write_test_model(folder / "target.gguf", architecture="llama", block_count=4).path,
        "other model": write_test_model(folder / "other.gguf", architecture="llama", block_count=2, seed=9).path,
        "other vocabulary": write_test_model(folder / "vocab.gguf", architecture="llama", shape=other_vocabulary).path,
    }


def header(path: Path) -> GGUFHeader:
    return read_model_header(str(path))[0]


def draft_model(files: dict[str, Path], which: str, *, speculation: Speculation = SPECULATION) -> DraftModel:
    source = DraftSource(url=str(files[which]), cache_type=CacheType.F32)
    target = files["target"]
    return load_draft_model(
        source, target=header(target), target_url=str(target), speculation=speculation, context=CONTEXT, slots=2
    )


async def generate(
    port: int, *, drafters: Callable[[tuple[int, ...]], Drafter | None] | None, metrics: GatewayMetrics,
    cancel_after: int = 0, sampling: Sampling = GREEDY,
) -> tuple[tuple[int, ...], str]:  # fmt: skip
    """The tokens of one greedy request and how it finished ("cancelled" when cancelled after `cancel_after`)."""
    ready = asyncio.Event()
    pipeline = Pipeline(
        first_stage=f"127.0.0.1:{port}", slots=2, context=CONTEXT, fence=FENCE, prefill_chunk=16, metrics=metrics,
        speculation=SPECULATION if drafters else None, drafters=drafters, probe_interval_s=0.05,
        on_ready_change=lambda now: ready.set() if now else None,
    )  # fmt: skip
    await pipeline.start()
    try:
        await asyncio.wait_for(ready.wait(), timeout=30)
        freed = asyncio.Event()
        generation = pipeline.submit(
            slot=0, prompt=PROMPT, max_tokens=NEW_TOKENS, sampling=sampling, stop_ids=frozenset(), on_freed=freed.set
        )
        tokens: list[int] = []
        finish = "cancelled"
        async with asyncio.timeout(60):
            async for event in generation.stream():
                if isinstance(event, Token):
                    tokens.append(event.token_id)
                    if len(tokens) == cancel_after:
                        pipeline.cancel(generation)
                        break
                elif isinstance(event, Finished):
                    finish = event.reason
            await freed.wait()
    finally:
        await pipeline.close()
    return tuple(tokens), finish


class Unpriced:
    """A draft model's drafter whose steps the driver takes as free. These tests check the text that verifying its
    drafts gives; on a CPU the draft costs what the target's step does, and the driver would stop drafting. Its
    proposals go through the draft model's shared steps, as the inner drafter's would."""

    computes = True
    token_seconds = start_seconds = 0.0

    def __init__(self, inner: DraftModelDrafter, shared: UnpricedLanes) -> None:
        self.inner = inner
        self.shared = shared

    def extend(self, tokens: Iterable[int]) -> None:
        self.inner.extend(tokens)

    def propose(self, limit: int) -> tuple[int, ...]:
        return self.inner.propose(limit)

    def close(self) -> None:
        self.inner.close()


class UnpricedLanes:
    """The draft model's shared proposals, for Unpriced drafters."""

    def __init__(self, model: DraftModel) -> None:
        self.model = model

    def propose(self, lanes: Sequence[tuple[Drafter, int]]) -> list[tuple[int, ...]]:
        inner = [(drafter.inner, limit) for drafter, limit in lanes if isinstance(drafter, Unpriced)]
        assert len(inner) == len(lanes), "only Unpriced drafters share these proposals"
        return self.model.propose(inner)


def unpriced(model: DraftModel) -> Callable[[tuple[int, ...]], Drafter | None]:
    lanes = UnpricedLanes(model)

    def drafter(prompt: tuple[int, ...]) -> Drafter | None:
        made = model.drafter(prompt)
        return None if made is None else Unpriced(made, lanes)

    return drafter


def counted(metrics: GatewayMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(f"strata_gateway_speculative_{name}_tokens_total")
    assert value is not None, f"{name} is not exported"
    return value


# Stages, the draft, the request's sampling, and the share of drafted tokens the target must accept at least.
OUTPUT_CASES = {
    "one stage, the target drafting for itself": (1, "target", GREEDY, 0.9),
    "two stages, the target drafting for itself": (2, "target", GREEDY, 0.9),
    "one stage, another model of the same vocabulary": (1, "other model", GREEDY, 0.0),
    "two stages, another model of the same vocabulary": (2, "other model", GREEDY, 0.0),
    "three stages, the target drafting for itself": (3, "target", GREEDY, 0.9),
    "three stages, another model of the same vocabulary": (3, "other model", GREEDY, 0.0),
    "two stages, sampled with a seed, the target drafting for itself": (2, "target", SAMPLED, 0.0),
}


@pytest.mark.parametrize(
    ("stage_count", "draft", "sampling", "acceptance"), OUTPUT_CASES.values(), ids=OUTPUT_CASES.keys()
)
def test_tokens_are_the_same_with_a_draft_model_as_without_speculation(
    files: dict[str, Path], stage_count: int, draft: str, sampling: Sampling, acceptance: float
) -> None:
    drafts = draft_model(files, draft)
    metrics = GatewayMetrics()
    with local_pipeline(files["target"], SPANS[stage_count], context=CONTEXT) as stages:
        port = stages[0].port
        off = asyncio.run(generate(port, drafters=None, metrics=GatewayMetrics(), sampling=sampling))
        on = asyncio.run(generate(port, drafters=unpriced(drafts), metrics=metrics, sampling=sampling))
    assert on == off
    assert off[1] == "length"
    drafted, accepted = counted(metrics, "drafted"), counted(metrics, "accepted")
    assert drafted > 0
    assert accepted >= acceptance * drafted, f"{accepted} of {drafted} drafted tokens accepted"
    assert drafts.free_slots == 2, "the finished request gave its draft slot back"


class GatedDrafter:
    """A drafter that computes, whose every proposal waits for a coroutine on the driver's loop to open its gate:
    run on the loop itself, it would wait out its timeout instead, and say so."""

    computes = True
    token_seconds = start_seconds = 0.0
    shared = None

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.proposals = 0
        self.blocked = 0  # proposals whose gate the loop did not open: they ran on the loop

    def extend(self, tokens: object) -> None:
        pass

    def propose(self, limit: int) -> tuple[int, ...]:
        self.proposals += 1
        self.gate.clear()  # only an opening after this one counts
        if not self.gate.wait(timeout=2):
            self.blocked += 1
        return ()

    def close(self) -> None:
        pass


def test_a_drafter_that_computes_proposes_off_the_drivers_loop(files: dict[str, Path]) -> None:
    drafter = GatedDrafter()

    async def run(port: int) -> None:
        async def open_gates() -> None:
            while True:
                drafter.gate.set()
                await asyncio.sleep(0.005)

        opener = asyncio.create_task(open_gates())
        try:
            await generate(port, drafters=lambda prompt: drafter, metrics=GatewayMetrics())
        finally:
            opener.cancel()

    with local_pipeline(files["target"], SPANS[1], context=CONTEXT) as stages:
        asyncio.run(run(stages[0].port))
    # Every decode step but the first, which times a one-position step of the pipeline to price drafts against.
    assert drafter.proposals >= NEW_TOKENS - 2
    assert drafter.blocked == 0, f"{drafter.blocked} proposals ran on the driver's loop"


def test_a_cancelled_request_gives_its_draft_slot_back(files: dict[str, Path]) -> None:
    drafts = draft_model(files, "target")
    with local_pipeline(files["target"], SPANS[1], context=CONTEXT) as stages:
        tokens, finish = asyncio.run(
            generate(stages[0].port, drafters=drafts.drafter, metrics=GatewayMetrics(), cancel_after=3)
        )
    assert (len(tokens), finish) == (3, "cancelled")
    assert drafts.free_slots == 2


def test_a_request_beyond_the_draft_slots_decodes_without_drafts_and_a_closed_drafter_frees_its_slot_once(
    files: dict[str, Path],
) -> None:
    drafts = draft_model(files, "other model")
    first, second = drafts.drafter(PROMPT), drafts.drafter(PROMPT)
    assert first is not None
    assert second is not None
    assert drafts.drafter(PROMPT) is None
    first.close()
    first.close()
    assert drafts.free_slots == 1
    assert first.propose(4) == ()
    assert drafts.drafter(PROMPT) is not None


def test_a_rejected_guess_is_fed_again_from_where_the_request_differs(files: dict[str, Path]) -> None:
    drafter = draft_model(files, "target").drafter(PROMPT)
    assert drafter is not None
    guess = drafter.propose(4)
    assert len(guess) == 4
    assert drafter.held == [*PROMPT, *guess[:3]], "the last guess is never fed"
    wrong = (guess[0] + 1) % 1000
    drafter.extend((wrong,))  # the target disagreed with the first guess
    again = drafter.propose(2)
    assert drafter.held[: len(PROMPT) + 1] == [*PROMPT, wrong]
    assert len(drafter.held) == len(PROMPT) + 2
    assert len(again) == 2


def test_a_loaded_draft_prices_its_first_proposal_by_measure_and_charges_the_prompts_feed_once(
    files: dict[str, Path],
) -> None:
    model = draft_model(files, "target")
    assert model.token_seconds > 0, "timed at load, before any proposal"
    assert model.feed_seconds > 0, "timed at load, before any proposal"
    assert model.engine.pool.length(0) == 0, "the timed feed left nothing in the slot"
    drafter = model.drafter(PROMPT)
    assert drafter is not None
    assert drafter.start_seconds == pytest.approx(len(PROMPT) * model.feed_seconds), "the prompt's feed"
    guess = drafter.propose(4)
    drafter.extend((*guess, 5))
    assert drafter.start_seconds == 0.0, "a decode step's feed is a draft token's cost, not a start"


def test_lanes_proposed_together_get_the_drafts_each_gets_alone(files: dict[str, Path]) -> None:
    """Two requests (the draft model's two slots) with other prompts and limits, over three rounds: the first
    proposal with the prompts' prefill, then one lane after all its guesses and a bonus token, the other after a
    rejected first guess; in shared steps on one draft model and one by one on another, the same drafts and slots."""
    limits = [4, 2]
    both: list[list[DraftModelDrafter]] = []
    for _ in range(2):
        model = draft_model(files, "target")
        made = [model.drafter(prompt) for prompt in (PROMPT, PROMPT[5:])]
        both.append([d for d in made if d is not None])
    alone, together = both
    assert len(alone) == len(together) == 2
    for round_ in range(3):
        expected = [d.propose(limit) for d, limit in zip(alone, limits, strict=True)]
        got = proposals([(d, limit) for d, limit in zip(together, limits, strict=True)])
        assert got == expected, f"round {round_}"
        assert all(expected), "every lane drafted: the rounds check feeds after guesses"
        assert [d.held for d in together] == [d.held for d in alone]
        for drafters in both:
            drafters[0].extend((*expected[0], 5))
            drafters[1].extend(((expected[1][0] + 1) % 1000,))


def test_a_lane_whose_draft_fails_goes_undrafted_and_the_others_keep_their_drafts(files: dict[str, Path]) -> None:
    """The first lane's prompt leaves its draft slot too few positions for its guesses: the shared step fails, each
    lane is tried alone, and only that one goes on without drafts (its drafter closed, its slot free)."""
    model, reference = draft_model(files, "target"), draft_model(files, "target")
    crowded = tuple(10 + i % 900 for i in range(CONTEXT - 2))
    failing, fine = model.drafter(crowded), model.drafter(PROMPT)
    alone = reference.drafter(PROMPT)
    assert failing is not None
    assert fine is not None
    assert alone is not None
    got = proposals([(failing, 4), (fine, 4)])
    assert got == [(), alone.propose(4)]
    assert failing.closed
    assert not fine.closed
    assert model.free_slots == 1


# The slot's tokens, the request's tokens, and how many positions stay before feeding.
KEPT_CASES = {
    "nothing held yet: feed the whole prompt": ((), (1, 2, 3), 0),
    "every token held: the last is fed again for its pick": ((1, 2, 3), (1, 2, 3), 2),
    "an accepted run and a bonus token: feed the bonus": ((1, 2, 3, 4), (1, 2, 3, 4, 5), 4),
    "a rejected guess: feed from where it differs": ((1, 2, 3, 9, 8), (1, 2, 3, 4), 3),
    "guesses held beyond an accepted one": ((1, 2, 3, 4, 5), (1, 2, 3, 4), 3),
}


@pytest.mark.parametrize(("held", "tokens", "kept"), KEPT_CASES.values(), ids=KEPT_CASES.keys())
def test_kept_positions(held: tuple[int, ...], tokens: tuple[int, ...], kept: int) -> None:
    assert kept_positions(held, tokens) == kept


# The floor, the limit, and how many tokens the target drafting for itself proposes.
FLOOR_CASES = {
    "no floor: as many as the limit": (Speculation(p_min=0.0), 4, 4),
    "a floor over every pick of a flat generated model: none": (Speculation(p_min=0.5), 4, 0),
    "under the minimum draft: none": (Speculation(p_min=0.0, min_draft=3), 2, 0),
    "the limit over the maximum draft: the maximum": (Speculation(p_min=0.0, max_draft=2), 4, 2),
}


@pytest.mark.parametrize(("speculation", "limit", "proposed"), FLOOR_CASES.values(), ids=FLOOR_CASES.keys())
def test_a_proposal_stops_at_the_floor_and_keeps_to_the_draft_bounds(
    files: dict[str, Path], speculation: Speculation, limit: int, proposed: int
) -> None:
    drafter = draft_model(files, "target", speculation=speculation).drafter(PROMPT)
    assert drafter is not None
    assert len(drafter.propose(limit)) == proposed


def renamed_token(h: GGUFHeader) -> GGUFHeader:
    tokens = h.metadata["tokenizer.ggml.tokens"]
    assert isinstance(tokens, tuple)
    return dataclasses.replace(h, metadata={**h.metadata, "tokenizer.ggml.tokens": (*tokens[:-1], "<|other|>")})


def untokenized(h: GGUFHeader) -> GGUFHeader:
    return dataclasses.replace(h, metadata={k: v for k, v in h.metadata.items() if k != "tokenizer.ggml.tokens"})


# The draft's header (made from the files) and what the refusal says.
REFUSAL_CASES: dict[str, tuple[Callable[[dict[str, Path]], GGUFHeader], tuple[str, ...]]] = {
    "a vocabulary of another size": (
        lambda f: header(f["other vocabulary"]),
        ("vocab.gguf has a vocabulary of 1200 tokens", "target.gguf one of"),
    ),
    "a token of other text": (lambda f: renamed_token(header(f["target"])), ("'<|other|>' in draft", "in target")),
    "no tokenizer tokens": (lambda f: untokenized(header(f["target"])), ("has no tokenizer tokens",)),
}


@pytest.mark.parametrize(("draft", "words"), REFUSAL_CASES.values(), ids=REFUSAL_CASES.keys())
def test_a_draft_of_another_vocabulary_is_refused_naming_both_files(
    files: dict[str, Path], draft: Callable[[dict[str, Path]], GGUFHeader], words: tuple[str, ...]
) -> None:
    refusal = vocabulary_refusal(
        target=header(files["target"]), draft=draft(files), target_name="/m/target.gguf", draft_name="/m/vocab.gguf"
    )
    assert refusal is not None
    for word in words:
        assert word in refusal


def test_loading_a_draft_of_another_vocabulary_fails_before_its_weights_are_read(files: dict[str, Path]) -> None:
    with pytest.raises(DraftModelError) as refused:
        draft_model(files, "other vocabulary")
    assert str(files["other vocabulary"]) in str(refused.value)
    assert str(files["target"]) in str(refused.value)
    assert (
        vocabulary_refusal(
            target=header(files["target"]), draft=header(files["other model"]), target_name="t", draft_name="d"
        )
        is None
    )
