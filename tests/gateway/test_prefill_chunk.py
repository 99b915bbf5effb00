"""A prompt goes in `prefill_chunk` tokens a step, chunks ending on multiples of it (after a restored prefix too), as
the gateway's settings say (STRATA_PREFILL_CHUNK, `strata serve --prefill-chunk`); a prefill chunk that the prefix
cache's chunk is not a multiple of is refused, since a restored prefix would then prefill other spans than a full
prefill."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from strata.gateway.generation import Sampling
from strata.gateway.pipeline import Pipeline
from strata.gateway.settings import DEFAULT_PREFILL_CHUNK, GatewaySettings, from_environment

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
    Span("a prompt shorter than the chunk goes whole", 1024, 1000, 0, (0, 1000)),
    Span("a wider chunk takes more a step", 2048, 3000, 0, (0, 2048)),
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
    "no tokens a step": ({"prefill_chunk": 0}, "the prefill chunk must be at least 1 token, not 0"),
    "wider than the prefix cache's chunk": (
        {"prefill_chunk": 512},
        "the prefix cache chunk \\(256 tokens\\) must be a multiple of the prefill chunk \\(512 tokens\\)",
    ),
    "not dividing the prefix cache's chunk": (
        {"prefill_chunk": 96, "prefix_cache_chunk": 256},
        "must be a multiple of the prefill chunk \\(96 tokens\\)",
    ),
}


@pytest.mark.parametrize(("values", "message"), REFUSED.values(), ids=REFUSED.keys())
def test_a_prefill_chunk_the_prefix_cache_cannot_restore_on_is_refused(values: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GatewaySettings(model_url="m.gguf", first_stage="127.0.0.1:1", context=64, **values)  # type: ignore[arg-type]


ACCEPTED = {
    "the default": ({}, DEFAULT_PREFILL_CHUNK),
    "a divisor of the prefix cache's chunk": ({"prefill_chunk": 128}, 128),
    "wider, with a prefix cache chunk of its multiple": ({"prefill_chunk": 2048, "prefix_cache_chunk": 4096}, 2048),
    "any width without a prefix cache": ({"prefill_chunk": 3000, "prefix_cache_chunk": 0}, 3000),
}


@pytest.mark.parametrize(("values", "expected"), ACCEPTED.values(), ids=ACCEPTED.keys())
def test_a_prefill_chunk_that_fits_the_prefix_cache_is_kept(values: dict[str, int], expected: int) -> None:
    settings = GatewaySettings(model_url="m.gguf", first_stage="127.0.0.1:1", context=64, **values)  # type: ignore[arg-type]
    assert settings.prefill_chunk == expected


def test_the_environment_sets_the_prefill_chunk() -> None:
    environ = {
        "STRATA_MODEL_URL": "m.gguf", "STRATA_FIRST_STAGE": "127.0.0.1:1", "STRATA_CONTEXT": "64",
        "STRATA_PREFILL_CHUNK": "1024", "STRATA_PREFIX_CACHE_CHUNK": "2048",
    }  # fmt: skip
    assert from_environment({}, environ).prefill_chunk == 1024
