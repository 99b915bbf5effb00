"""A prompt goes in `prefill_chunk` tokens a step, chunks ending on multiples of it (after a restored prefix too), as
the gateway's settings say (STRATA_PREFILL_CHUNK, `strata serve --prefill-chunk`); a chunk wider than the rows a step
the plan sizes a stage for (UBATCH_TOKENS) is refused."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from strata.gateway.generation import Sampling
from strata.gateway.pipeline import Pipeline
from strata.gateway.settings import DEFAULT_PREFILL_CHUNK, GatewaySettings, from_environment
from strata.gguf.model import UBATCH_TOKENS

CONTEXT = 4096


@dataclass(frozen=True)
class Span:
    name: str
    prefill_chunk: int
    prompt: int  # prompt tokens
    fed: int  # of them already in the pool (a restored prefix, or earlier chunks)
    expected: tuple[int, int]  # the step's chunk: start position, length


SPANS = [
    Span("the first chunk of a long prompt", 256, 1000, 0, (0, 256)),
    Span("a later chunk", 256, 1000, 512, (512, 256)),
    Span("the last chunk ends with the prompt", 256, 1000, 768, (768, 232)),
    Span("a prompt shorter than the chunk goes whole", 512, 300, 0, (0, 300)),
    Span("a wider chunk takes more a step", 512, 3000, 0, (0, 512)),
    Span("a restored prefix off the prefix cache's own chunk ends on the next multiple", 512, 3000, 48, (48, 464)),
    Span("after a restored prefix the chunk ends on the next multiple", 64, 300, 10, (10, 54)),
]


@pytest.mark.parametrize("case", SPANS, ids=lambda c: c.name)
def test_a_prompt_is_prefilled_in_chunks_of_the_configured_size(case: Span) -> None:
    pipeline = Pipeline(
        first_stage="127.0.0.1:1", slots=1, context=CONTEXT, fence=None, prefill_chunk=case.prefill_chunk
    )
    pipeline._ready = True
    g = pipeline.submit(
        slot=0, prompt=tuple(range(3, 3 + case.prompt)), max_tokens=8, sampling=Sampling(), stop_ids=frozenset(),
        on_freed=lambda: None,
    )  # fmt: skip
    g.fed = case.fed
    (chunk,) = pipeline._chunks()
    assert (chunk.start_position, chunk.length) == case.expected
    assert list(chunk.token_ids) == list(range(3 + case.fed, 3 + case.fed + case.expected[1]))
    assert chunk.sample == (sum(case.expected) == case.prompt)


REFUSED = {
    "no tokens a step": ({"prefill_chunk": 0}, "the prefill chunk must be 1 to 512 tokens .*, not 0"),
    "wider than the plan's micro-batch": ({"prefill_chunk": 513}, "must be 1 to 512 tokens .*, not 513"),
}


@pytest.mark.parametrize(("values", "message"), REFUSED.values(), ids=REFUSED.keys())
def test_a_prefill_chunk_the_stages_are_not_planned_for_is_refused(values: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GatewaySettings(model_url="m.gguf", first_stage="127.0.0.1:1", context=64, **values)  # type: ignore[arg-type]


ACCEPTED = {
    "the default": ({}, DEFAULT_PREFILL_CHUNK),
    "narrower": ({"prefill_chunk": 64}, 64),
    "the plan's micro-batch": ({"prefill_chunk": UBATCH_TOKENS}, UBATCH_TOKENS),
    "wider than the prefix cache's chunk": ({"prefill_chunk": 512, "prefix_cache_chunk": 16}, 512),
}


@pytest.mark.parametrize(("values", "expected"), ACCEPTED.values(), ids=ACCEPTED.keys())
def test_a_prefill_chunk_the_stages_take_is_kept(values: dict[str, int], expected: int) -> None:
    settings = GatewaySettings(model_url="m.gguf", first_stage="127.0.0.1:1", context=64, **values)  # type: ignore[arg-type]
    assert settings.prefill_chunk == expected


def test_the_environment_sets_the_prefill_chunk() -> None:
    environ = {
        "STRATA_MODEL_URL": "m.gguf", "STRATA_FIRST_STAGE": "127.0.0.1:1", "STRATA_CONTEXT": "64",
        "STRATA_PREFILL_CHUNK": "512",
    }  # fmt: skip
    assert from_environment({}, environ).prefill_chunk == 512
