"""Speculative decoding through the coordinator's driver on real stage servers: the same greedy tokens with
speculation on as off across 1, 2 and 3 stages and under a grammar, drafts counted and accepted, fewer steps, and a
stop token or the length ending the generation where it ends without speculation."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from strata.gateway.errors import PipelineError
from strata.gateway.generation import Finished, Sampling, Token
from strata.gateway.grammar import Constraint, Grammars
from strata.gateway.metrics import GatewayMetrics
from strata.gateway.pipeline import Pipeline
from strata.gateway.speculation import Speculation
from strata.gateway.tokenizer import GGUFTokenizer, TokenizerSpec
from strata.gguf import read_model_header
from strata.gguf.model import CacheType
from strata.gguf.testmodels import write_test_model
from strata.lease import FencingToken
from strata.rpc.v1 import stage_pb2
from strata.stage_worker.server import StageService
from strata_testbed.pipelines import local_pipeline

SPANS = {1: [(0, 4)], 2: [(0, 2), (2, 4)], 3: [(0, 1), (1, 3), (3, 4)]}
FENCE = FencingToken(lease_uid="lease", term=1, holder="speculation-test")
# Code being edited repeats itself: the greedy continuation of a generated model falls into loops too, so n-gram
# lookup finds drafts in the prompt and in the output alike.
PROMPT = (*range(30, 50), *range(30, 45), 7, 8, *range(30, 40))
NEW_TOKENS = 24
GREEDY = Sampling()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("speculation")
    return write_test_model(folder / "llama.gguf", architecture="llama", block_count=4).path


@dataclass(frozen=True)
class Outcome:
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish: str
    steps: int


async def generate(
    port: int, *, speculation: Speculation | None, sampled_beside: bool, metrics: GatewayMetrics,
    stop_ids: frozenset[int] = frozenset(), max_tokens: int = NEW_TOKENS, sampling: Sampling = GREEDY,
    constraint: Callable[[], Constraint] | None = None,
) -> Outcome:  # fmt: skip
    ready = asyncio.Event()
    pipeline = Pipeline(
        first_stage=f"127.0.0.1:{port}", slots=2, context=256, fence=FENCE, prefill_chunk=16, metrics=metrics,
        speculation=speculation, probe_interval_s=0.05, on_ready_change=lambda now: ready.set() if now else None,
    )  # fmt: skip
    await pipeline.start()
    try:
        await asyncio.wait_for(ready.wait(), timeout=30)
        freed = asyncio.Event()
        greedy = pipeline.submit(
            slot=0, prompt=PROMPT, max_tokens=max_tokens, sampling=sampling, stop_ids=stop_ids, on_freed=freed.set,
            constraint=None if constraint is None else constraint(),
        )  # fmt: skip
        if sampled_beside:  # a request that is never drafted, decoding in the same steps
            pipeline.submit(
                slot=1, prompt=PROMPT[:9], max_tokens=NEW_TOKENS, sampling=Sampling(temperature=0.8, seed=3),
                stop_ids=frozenset(), on_freed=lambda: None,
            )  # fmt: skip
        events = [event async for event in greedy.stream()]
        await asyncio.wait_for(freed.wait(), timeout=30)
        steps = pipeline._step_id
    finally:
        await pipeline.close()
    tokens = [e for e in events if isinstance(e, Token)]
    finished = events[-1]
    assert isinstance(finished, Finished)
    return Outcome(
        tuple(t.token_id for t in tokens), tuple(t.logprob for t in tokens), finished.reason, steps
    )  # fmt: skip


def counted(metrics: GatewayMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(f"strata_gateway_speculative_{name}_tokens_total")
    assert value is not None, f"{name} is not exported"
    return value


# A generated model's logits are nearly flat: at a low temperature its sampled text repeats itself, as real text does.
SAMPLED = Sampling(temperature=0.05, seed=3)


@pytest.mark.parametrize(
    ("stage_count", "cache_type", "sampling", "sampled_beside"),
    [
        pytest.param(1, CacheType.F32, GREEDY, False, id="one stage"),
        pytest.param(2, CacheType.F32, GREEDY, False, id="two stages"),
        pytest.param(3, CacheType.F32, GREEDY, False, id="three stages"),
        pytest.param(2, CacheType.Q8_0, GREEDY, True, id="two stages, q8_0 cache, a sampled request beside"),
        pytest.param(2, CacheType.F32, SAMPLED, False, id="two stages, sampled with a seed"),
    ],
)
def test_tokens_are_the_same_with_speculation_on_and_off(
    model: Path, stage_count: int, cache_type: CacheType, sampling: Sampling, sampled_beside: bool
) -> None:
    shape = {"sampled_beside": sampled_beside, "sampling": sampling}
    with local_pipeline(model, SPANS[stage_count], context=256, cache_type=cache_type) as stages:
        port = stages[0].port
        off = asyncio.run(generate(port, speculation=None, metrics=GatewayMetrics(), **shape))  # type: ignore[arg-type]
        metrics = GatewayMetrics()
        on = asyncio.run(generate(port, speculation=Speculation(), metrics=metrics, **shape))  # type: ignore[arg-type]
    assert on.tokens == off.tokens
    assert on.logprobs == pytest.approx(off.logprobs, abs=1e-4), "the target's own log-probabilities"
    assert on.finish == off.finish == "length"
    drafted, accepted = counted(metrics, "drafted"), counted(metrics, "accepted")
    assert 0 < accepted <= drafted
    runs = metrics.registry.get_sample_value("strata_gateway_speculative_run_tokens_count")
    run_tokens = metrics.registry.get_sample_value("strata_gateway_speculative_run_tokens_sum")
    assert runs is not None
    assert run_tokens == runs + accepted, "each run: its accepted drafts and one pick"
    if not sampled_beside:  # with another request beside, the step count is both requests'
        assert on.steps <= off.steps - accepted, "each accepted draft saved a step"


def test_a_stop_or_the_length_ends_a_speculative_generation_where_it_ends_without(model: Path) -> None:
    with local_pipeline(model, SPANS[1], context=256) as stages:
        port = stages[0].port
        full = asyncio.run(generate(port, speculation=None, sampled_beside=False, metrics=GatewayMetrics()))
        # The first token after the prompt that speculation can propose: one seen before in the context.
        at = next(i for i, t in enumerate(full.tokens) if i > 2 and t in PROMPT + full.tokens[:i])
        stop = frozenset({full.tokens[at]})
        stopped = asyncio.run(
            generate(port, speculation=Speculation(), sampled_beside=False, metrics=GatewayMetrics(), stop_ids=stop)
        )
        short = asyncio.run(
            generate(port, speculation=Speculation(), sampled_beside=False, metrics=GatewayMetrics(), max_tokens=at)
        )
    first = full.tokens.index(full.tokens[at])
    assert (stopped.tokens, stopped.finish) == (full.tokens[: first + 1], "stop")
    assert (short.tokens, short.finish) == (full.tokens[:at], "length")


@pytest.mark.parametrize("speculation", [None, Speculation()], ids=["one position a step", "speculating"])
def test_a_last_stage_that_answers_a_sampled_chunk_with_no_token_ends_the_generation_with_an_error(
    model: Path, speculation: Speculation | None
) -> None:
    async def broken(port: int, service: StageService) -> BaseException:
        ready = asyncio.Event()
        pipeline = Pipeline(
            first_stage=f"127.0.0.1:{port}", slots=2, context=256, fence=FENCE, speculation=speculation,
            probe_interval_s=0.05, on_ready_change=lambda now: ready.set() if now else None,
        )  # fmt: skip
        await pipeline.start()
        try:
            await asyncio.wait_for(ready.wait(), timeout=30)
            service.last_step = lambda request, handed=None: stage_pb2.ForwardReply(step_id=request.step_id)  # type: ignore[method-assign]
            generation = pipeline.submit(
                slot=0, prompt=PROMPT, max_tokens=8, sampling=GREEDY, stop_ids=frozenset(), on_freed=lambda: None
            )

            async def drain() -> None:
                async for _ in generation.stream():
                    pass

            with pytest.raises(PipelineError) as failed:
                await asyncio.wait_for(drain(), timeout=30)
            return failed.value
        finally:
            await pipeline.close()

    with local_pipeline(model, SPANS[1], context=256) as stages:
        error = asyncio.run(broken(stages[0].port, stages[0].service))
    assert "with no token for 0" in str(error)


def test_under_a_grammar_each_drafted_pick_takes_the_mask_its_draft_leads_to(model: Path) -> None:
    """Digits and a few letters only: the flat logits of a generated model loop inside the mask, so n-gram drafts are
    proposed, cut before any token the grammar refuses, and accepted; the text is the one without speculation."""
    tokenizer = GGUFTokenizer(TokenizerSpec.from_metadata(read_model_header(str(model))[0].metadata))
    grammars = Grammars(tokenizer)
    grammar = grammars.lark("start: /[0-9a-c]{80}/", param="grammar")

    def constraint() -> Constraint:
        return grammars.start(grammar)

    with local_pipeline(model, SPANS[2], context=256) as stages:
        port = stages[0].port
        off = asyncio.run(
            generate(port, speculation=None, sampled_beside=False, metrics=GatewayMetrics(), constraint=constraint)
        )
        metrics = GatewayMetrics()
        on = asyncio.run(
            generate(port, speculation=Speculation(), sampled_beside=False, metrics=metrics, constraint=constraint)
        )
    text = tokenizer.decode(list(off.tokens))
    assert text
    assert set(text) <= set("0123456789abc"), text
    assert on.tokens == off.tokens
    assert 0 < counted(metrics, "accepted") <= counted(metrics, "drafted")
