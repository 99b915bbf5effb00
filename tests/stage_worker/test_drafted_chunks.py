"""Drafted chunks on the engines of a real generated model: the last stage keeps exactly the tokens one position a
step picks, the rejected positions never reach a later step, and a chunk it cannot verify is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from strata.gguf.model import CacheType
from strata.stage_worker.engine import Chunk, Engine
from strata.stage_worker.errors import InvalidRequestError
from strata.stage_worker.sampling import Sampling
from strata_testbed.stages import cpu_engines, through

CPU = torch.device("cpu")
PROMPT = (1, 17, 200, 3, 45, 99, 12, 7, 250, 31, 64, 128)
STEPS = 10
SPANS = {"one stage": [(0, 3)], "three stages": [(0, 1), (1, 2), (2, 3)]}


def one_at_a_time(stages: list[Engine], *, slot: int, steps: int, sampling: Sampling) -> list[int]:
    """The tokens after PROMPT, one position a step."""
    first = Chunk(slot, 0, len(PROMPT), PROMPT, sample=True, sampling=sampling)
    picked = [through(stages, [first]).tokens[slot].token_id]
    for _ in range(steps - 1):
        position = len(PROMPT) + len(picked) - 1
        step = through(stages, [Chunk(slot, position, 1, (picked[-1],), sample=True, sampling=sampling)])
        picked.append(step.tokens[slot].token_id)
    return picked


def speculating(
    stages: list[Engine], *, slot: int, guess: list[int], other: int, sampling: Sampling
) -> list[list[int]]:
    """The tokens after PROMPT when every step drafts 3 tokens from `guess` (the true continuation with every third
    token replaced by `other`, so some drafts are accepted and some rejected), beside a plain decode row of the
    other slot in the same step; the runs of each step."""
    runs: list[list[int]] = []
    first = Chunk(slot, 0, len(PROMPT), PROMPT, sample=True, sampling=sampling)
    picked = [through(stages, [first]).tokens[slot].token_id]
    beside = 1 - slot
    through(stages, [Chunk(beside, 0, 3, PROMPT[:3], sample=True)])
    while len(picked) < STEPS:
        start = len(PROMPT) + len(picked) - 1
        draft = tuple(other if (len(picked) + i) % 3 == 0 else t for i, t in enumerate(guess[len(picked) :][:3]))
        chunk = Chunk(
            slot, start, 1 + len(draft), (picked[-1], *draft), sample=True, sampling=sampling, drafted=len(draft)
        )
        result = through(stages, [chunk, Chunk(beside, 3, 1, (5,), sample=True)])  # beside: position 3 again
        runs.append([s.token_id for s in result.runs[slot]])
        picked.extend(runs[-1])
    return runs


SAMPLINGS = {"greedy": Sampling(), "sampled at temperature 1, seeded": Sampling(temperature=1.0, seed=7)}


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
@pytest.mark.parametrize("cache_type", [CacheType.F32, CacheType.Q8_0], ids=["f32 cache", "q8_0 cache"])
@pytest.mark.parametrize("spans", SPANS.values(), ids=SPANS.keys())
def test_verified_drafts_give_the_tokens_of_one_position_a_step(
    tiny_models: dict[str, Path], spans: list[tuple[int, int]], cache_type: CacheType, sampling: Sampling
) -> None:
    """Sampled picks are the same seeded draws as one position a step makes: the same text, so the same
    distribution, and a draft counts exactly when the draw is the draft."""
    plain = cpu_engines(tiny_models["llama"], spans, cache_type=cache_type)
    reference = one_at_a_time(plain, slot=0, steps=STEPS + 3, sampling=sampling)
    other = next(t for t in range(1, 300) if t not in reference)
    drafting = cpu_engines(tiny_models["llama"], spans, cache_type=cache_type)
    runs = speculating(drafting, slot=1, guess=reference, other=other, sampling=sampling)
    assert [t for run in runs for t in run][: STEPS - 1] == reference[1:STEPS]
    assert any(len(run) > 1 for run in runs), "some drafts were accepted"
    assert any(len(run) < 4 for run in runs), "some drafts were rejected and later steps went on after them"


BAD_CHUNKS = {
    "nothing but drafts": Chunk(0, 0, 2, (3, 4), sample=True, drafted=2),
    "token ids missing": Chunk(0, 0, 3, (3,), sample=True, drafted=2),
    "no sampling": Chunk(0, 0, 3, (3, 4, 5), drafted=2),
    "logits asked for": Chunk(0, 0, 3, (3, 4, 5), sample=True, return_logits=True, drafted=2),
    "a grammar's mask for the first pick only": Chunk(
        0, 0, 3, (3, 4, 5), sample=True, sampling=Sampling(allowed=b"\xff"), drafted=2
    ),
    "masks for drafted picks on a chunk without drafts": Chunk(
        0, 0, 3, (3, 4, 5), sample=True, draft_allowed=(b"\xff",)
    ),
    "masks for the drafted picks without the first's": Chunk(
        0, 0, 3, (3, 4, 5), sample=True, drafted=2, draft_allowed=(b"\xff", b"\xff")
    ),
    "a repetition penalty": Chunk(
        0, 0, 3, (3, 4, 5), sample=True, sampling=Sampling(repetition_penalty=1.2, penalized=(3,)), drafted=2
    ),
}


@pytest.mark.parametrize("chunk", BAD_CHUNKS.values(), ids=BAD_CHUNKS.keys())
def test_a_drafted_chunk_the_last_stage_cannot_verify_is_refused(tiny_models: dict[str, Path], chunk: Chunk) -> None:
    (engine,) = cpu_engines(tiny_models["llama"], SPANS["one stage"], cache_type=CacheType.F32)
    with pytest.raises(InvalidRequestError, match=r"slot 0: .*draft"):
        engine.step([chunk], None)
    assert engine.pool.length(0) == 0, "a refused step changes nothing"


def only(token: int, *, vocab: int) -> bytes:
    """A grammar's mask that allows one token: bit token % 32 of little-endian uint32 word token // 32."""
    words = [0] * ((vocab + 31) // 32)
    words[token // 32] |= 1 << (token % 32)
    return b"".join(word.to_bytes(4, "little") for word in words)


MASKED = {
    "every draft allowed and picked": ((40, 41), (40, 41, 9), (40, 41, 9)),
    "the second pick's mask refuses the draft": ((40, 41), (40, 5, 9), (40, 5)),
}


@pytest.mark.parametrize(("draft", "forced", "run"), MASKED.values(), ids=MASKED.keys())
def test_each_pick_of_a_drafted_chunk_samples_inside_its_own_mask(
    tiny_models: dict[str, Path], draft: tuple[int, ...], forced: tuple[int, ...], run: tuple[int, ...]
) -> None:
    """Masks that allow one token each force the picks, so the run shows which mask each pick took."""
    (engine,) = cpu_engines(tiny_models["llama"], SPANS["one stage"], cache_type=CacheType.F32)
    engine.step([Chunk(0, 0, len(PROMPT), PROMPT)], None)
    masks = [only(token, vocab=engine.model.config.vocab_size) for token in forced]
    chunk = Chunk(
        0, len(PROMPT), 1 + len(draft), (7, *draft), sample=True, sampling=Sampling(allowed=masks[0]),
        drafted=len(draft), draft_allowed=tuple(masks[1:]),
    )  # fmt: skip
    result = engine.step([chunk], None)
    assert tuple(s.token_id for s in result.runs[0]) == run
