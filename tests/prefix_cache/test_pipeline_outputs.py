"""The coordinator's prefix cache on real stage servers: the same greedy tokens and log-probabilities with the cache
on as off, across 1, 2 and 3 stages and a q8_0 cache; restored prefixes counted as cached tokens; and a snapshot lost
or evicted on any stage costs a full prefill, never a different output."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from strata.gateway.generation import Sampling, Token
from strata.gateway.metrics import GatewayMetrics
from strata.gateway.pipeline import Pipeline
from strata.gguf.model import CacheType
from strata.lease import FencingToken
from strata.stage_worker.engine import Chunk, StepResult
from strata.stage_worker.server import RunningStage
from strata_testbed.pipelines import local_pipeline
from torch import Tensor

CHUNK = 16  # prefix chunk and prefill chunk alike, so a restored prefix ends where a prefill chunk would
SYSTEM = tuple(range(40, 80))  # 40 tokens every conversation starts with: two whole chunks
NEW_TOKENS = 8
SPANS = {1: [(0, 3)], 2: [(0, 2), (2, 3)], 3: [(0, 1), (1, 2), (2, 3)]}
BUDGET = 1 << 20
FENCE = FencingToken(lease_uid="lease", term=1, holder="prefix-test")


@dataclass(frozen=True)
class Turn:
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    cached: int


def conversation(previous: list[Turn]) -> tuple[int, ...] | None:
    """Four prompts: a question, another question on the same system prompt, a follow-up that resends the whole
    first exchange, and the first question again."""
    first = (*SYSTEM, 5, 6, 7, 8, 9, 10, 11)
    match len(previous):
        case 0:
            return first
        case 1:
            return (*SYSTEM, 200, 201, 202)
        case 2:
            return first + previous[0].tokens + (300, 301, 302, 303)
        case 3:
            return first
    return None


Prompts = Callable[[list[Turn]], tuple[int, ...] | None]


async def _started(port: int, *, prefix_chunk: int, metrics: GatewayMetrics, slots: int = 2) -> Pipeline:
    ready = asyncio.Event()
    pipeline = Pipeline(
        first_stage=f"127.0.0.1:{port}",
        slots=slots,
        context=256,
        fence=FENCE,
        prefill_chunk=CHUNK,
        prefix_chunk=prefix_chunk,
        metrics=metrics,
        probe_interval_s=0.05,
        on_ready_change=lambda now: ready.set() if now else None,
    )
    await pipeline.start()
    try:
        await asyncio.wait_for(ready.wait(), timeout=30)
    except BaseException:
        await pipeline.close()
        raise
    return pipeline


async def _turn(pipeline: Pipeline, *, slot: int, prompt: tuple[int, ...]) -> Turn:
    freed = asyncio.Event()
    generation = pipeline.submit(
        slot=slot,
        prompt=prompt,
        max_tokens=NEW_TOKENS,
        sampling=Sampling(temperature=0.0),
        stop_ids=frozenset(),
        on_freed=freed.set,
    )
    events = [event async for event in generation.stream() if isinstance(event, Token)]
    await asyncio.wait_for(freed.wait(), timeout=30)
    return Turn(
        prompt=prompt,
        tokens=tuple(e.token_id for e in events),
        logprobs=tuple(e.logprob for e in events),
        cached=generation.cached,
    )


async def _run(port: int, *, prefix_chunk: int, metrics: GatewayMetrics, prompts: Prompts) -> list[Turn]:
    pipeline = await _started(port, prefix_chunk=prefix_chunk, metrics=metrics)
    turns: list[Turn] = []
    try:
        while (prompt := prompts(turns)) is not None:
            turns.append(await _turn(pipeline, slot=len(turns) % 2, prompt=prompt))
    finally:
        await pipeline.close()
    return turns


async def _together(port: int, *, prefix_chunk: int, prompts: list[tuple[int, ...]]) -> list[Turn]:
    """Every prompt submitted at once, one slot each."""
    pipeline = await _started(port, prefix_chunk=prefix_chunk, metrics=GatewayMetrics(), slots=len(prompts))
    try:
        return list(await asyncio.gather(*(_turn(pipeline, slot=i, prompt=p) for i, p in enumerate(prompts))))
    finally:
        await pipeline.close()


def run(
    stages: list[RunningStage], *, prefix_chunk: int, metrics: GatewayMetrics | None = None, prompts: Prompts
) -> list[Turn]:
    return asyncio.run(
        _run(stages[0].port, prefix_chunk=prefix_chunk, metrics=metrics or GatewayMetrics(), prompts=prompts)
    )


def figure(metrics: GatewayMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(f"strata_gateway_prefix_cache_{name}", {"pipeline": "0"})
    assert value is not None, f"{name} is not exported"
    return value


@pytest.mark.parametrize(
    ("stage_count", "cache_type"),
    [
        pytest.param(1, CacheType.F32, id="one stage"),
        pytest.param(2, CacheType.F32, id="two stages"),
        pytest.param(3, CacheType.F32, id="three stages"),
        pytest.param(3, CacheType.Q8_0, id="three stages with a q8_0 cache"),
    ],
)
def test_outputs_are_identical_with_the_cache_on_and_off(
    prefix_models: dict[str, Path], stage_count: int, cache_type: CacheType
) -> None:
    with local_pipeline(
        prefix_models["qwen2"],
        SPANS[stage_count],
        context=256,
        cache_type=cache_type,
        prefix_cache_bytes=BUDGET,
    ) as stages:
        off = run(stages, prefix_chunk=0, prompts=conversation)
        metrics = GatewayMetrics()
        on = run(stages, prefix_chunk=CHUNK, metrics=metrics, prompts=conversation)
    assert [t.prompt for t in on] == [t.prompt for t in off]
    assert [t.tokens for t in on] == [t.tokens for t in off]
    assert [t.logprobs for t in on] == [t.logprobs for t in off], "restored KV is bit-exact, so are the logits"
    assert [t.cached for t in off] == [0, 0, 0, 0]
    # The first turn (47 tokens) saves its first 32; the second shares the 40-token system prompt and restores 32 of
    # it; the follow-up (59 tokens) restores the same 32 and saves 48; the first question again (47 tokens) restores
    # 32 of that: always whole chunks, and never the whole prompt.
    assert [t.cached for t in on] == [0, 32, 32, 32]
    assert (figure(metrics, "hits_total"), figure(metrics, "misses_total")) == (3, 1)
    assert figure(metrics, "cached_tokens_total") == 96
    assert figure(metrics, "bytes") > 0


def test_a_snapshot_lost_on_one_stage_falls_back_to_a_full_prefill_with_the_same_output(
    prefix_models: dict[str, Path],
) -> None:
    same = (*SYSTEM, 9, 9, 9)

    def twice(previous: list[Turn]) -> tuple[int, ...] | None:
        return same if len(previous) < 3 else None

    with local_pipeline(prefix_models["llama"], SPANS[3], context=256, prefix_cache_bytes=BUDGET) as stages:
        off = run(stages, prefix_chunk=0, prompts=twice)
        metrics = GatewayMetrics()

        def losing(previous: list[Turn]) -> tuple[int, ...] | None:
            if len(previous) == 1:
                stages[1].service.prefix_cache.clear()  # the middle stage restarted, say
            return twice(previous)

        on = run(stages, prefix_chunk=CHUNK, metrics=metrics, prompts=losing)
        middle = stages[1].service.prefix_cache.stats()
    assert [t.tokens for t in on] == [t.tokens for t in off]
    assert [t.logprobs for t in on] == [t.logprobs for t in off]
    assert [t.cached for t in on] == [0, 0, 32], "the miss prefilled everything; the next request hit again"
    assert (figure(metrics, "hits_total"), figure(metrics, "misses_total")) == (1, 2)
    assert (middle.hits, middle.misses) == (1, 1)


@pytest.mark.parametrize(
    ("host_snapshots", "cached", "slot_0_positions", "hits"),
    [
        pytest.param(0, [0, 0, 0, 32], 1 + 40 + 40, 1, id="without a host tier a's return is prefilled whole"),
        pytest.param(2, [0, 0, 32, 32], 1 + 40 + 8, 2, id="a's return comes back from the host tier"),
    ],
)
def test_a_small_budget_evicts_the_oldest_conversation_and_its_return_is_restored_from_the_host_or_prefilled(
    prefix_models: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    host_snapshots: int,
    cached: list[int],
    slot_0_positions: int,
    hits: int,
) -> None:
    a, b = tuple(range(100, 140)), tuple(range(140, 180))

    def alternating(previous: list[Turn]) -> tuple[int, ...] | None:
        return (a, b, a, a)[len(previous)] if len(previous) < 4 else None

    with local_pipeline(prefix_models["llama"], SPANS[3], context=256) as probe:
        cell_bytes = {stage.service.engine.pool.cell_bytes for stage in probe}
    assert len(cell_bytes) == 1, "one layer a stage: every stage's snapshot of 32 tokens is the same size"
    one_snapshot = 32 * cell_bytes.pop()
    with local_pipeline(
        prefix_models["llama"],
        SPANS[3],
        context=256,
        prefix_cache_bytes=one_snapshot + one_snapshot // 2,
        kv_host_bytes=host_snapshots * one_snapshot,
    ) as stages:
        off = run(stages, prefix_chunk=0, prompts=alternating)
        metrics = GatewayMetrics()
        seen = counted_steps(stages, monkeypatch)
        on = run(stages, prefix_chunk=CHUNK, metrics=metrics, prompts=alternating)
        held = [stage.service.prefix_cache.stats() for stage in stages]
    assert [t.tokens for t in on] == [t.tokens for t in off]
    assert [t.cached for t in on] == cached
    for chunks in seen:
        # Slot 0 took the readiness probe, a's first turn and a's return; what the return computed is the point.
        assert prompt_positions(chunks, slot=0, prompt_length=len(a)) == slot_0_positions
    assert all(s.bytes_held <= s.budget_bytes and s.snapshots == 1 for s in held)
    assert figure(metrics, "evictions_total") == 2 * len(stages)
    assert (figure(metrics, "hits_total"), figure(metrics, "misses_total")) == (hits, 4 - hits)


@pytest.mark.parametrize(
    ("prompts", "cached"),
    [
        pytest.param([(*SYSTEM, 1, 2, 3)] * 3, [0, 32, 32], id="one prompt three times at once (n = 3)"),
        pytest.param(
            [(*SYSTEM[:32], 1, 2), (*SYSTEM[:32], 1, 2, 4, 5, 6)], [0, 32], id="a prompt that extends one in prefill"
        ),
        pytest.param(
            [(*SYSTEM, *range(1, 10)), (*SYSTEM[:32], 7, 7)], [0, 0], id="a prompt the other's prefill outgrows"
        ),
    ],
)
def test_prompts_sent_together_prefill_a_shared_prefix_once(
    prefix_models: dict[str, Path], prompts: list[tuple[int, ...]], cached: list[int]
) -> None:
    """A generation whose prompt begins with the whole chunk-aligned part of another's that is being prefilled waits
    for it and restores it, with the same output; one that would wait for more than its own prefill does not."""
    with local_pipeline(
        prefix_models["qwen2"], SPANS[2], context=256, parallel=len(prompts), prefix_cache_bytes=BUDGET
    ) as stages:
        port = stages[0].port
        off = asyncio.run(_together(port, prefix_chunk=0, prompts=prompts))
        on = asyncio.run(_together(port, prefix_chunk=CHUNK, prompts=prompts))
    assert [t.cached for t in on] == cached
    assert [t.tokens for t in on] == [t.tokens for t in off]
    # Steps batch the prompts differently with and without waiting, so sums round differently: close, not bit-equal.
    assert [t.logprobs for t in on] == [pytest.approx(t.logprobs, abs=1e-4) for t in off]


def counted_steps(stages: list[RunningStage], monkeypatch: pytest.MonkeyPatch) -> list[list[tuple[int, int, int]]]:
    """Per stage, the (slot, start, length) of every chunk its engine computes from now on."""
    seen: list[list[tuple[int, int, int]]] = []
    for stage in stages:
        engine = stage.service.engine
        chunks_of: list[tuple[int, int, int]] = []
        seen.append(chunks_of)

        def counted(
            chunks: list[Chunk],
            hidden: Tensor | None,
            *,
            into: list[tuple[int, int, int]] = chunks_of,
            step: Callable[[list[Chunk], Tensor | None], StepResult] = engine.step,
        ) -> StepResult:
            into.extend((c.slot, c.start_position, c.length) for c in chunks)
            return step(chunks, hidden)

        monkeypatch.setattr(engine, "step", counted)
    return seen


def prompt_positions(chunks: list[tuple[int, int, int]], *, slot: int, prompt_length: int) -> int:
    """How many of a prompt's positions a stage computed for `slot`: the parts of its chunks before prompt_length."""
    return sum(max(0, min(start + length, prompt_length) - start) for s, start, length in chunks if s == slot)


@pytest.mark.parametrize(
    ("stage_count", "cache_type"),
    [
        pytest.param(1, CacheType.F32, id="one stage"),
        pytest.param(3, CacheType.Q8_0, id="three stages with a q8_0 cache"),
    ],
)
def test_a_prompt_sharing_ninety_percent_of_an_earlier_one_computes_only_the_rest_on_every_stage(
    prefix_models: dict[str, Path], stage_count: int, cache_type: CacheType, monkeypatch: pytest.MonkeyPatch
) -> None:
    earlier = tuple(range(20, 180))  # 160 tokens: ten chunks, saved whole
    later = (*earlier[:144], *range(200, 216))  # its first 144 tokens (90%, nine chunks) and 16 new ones

    def two_turns(previous: list[Turn]) -> tuple[int, ...] | None:
        return (earlier, later)[len(previous)] if len(previous) < 2 else None

    with local_pipeline(
        prefix_models["llama"], SPANS[stage_count], context=256, cache_type=cache_type, prefix_cache_bytes=BUDGET
    ) as stages:
        seen = counted_steps(stages, monkeypatch)
        turns = run(stages, prefix_chunk=CHUNK, prompts=two_turns)
    assert [t.cached for t in turns] == [0, 144]
    for chunks in seen:
        probe = (0, 0, 1)  # the coordinator's readiness probe, one position on slot 0 before any request
        assert chunks[0] == probe
        assert prompt_positions(chunks[1:], slot=0, prompt_length=len(earlier)) == 160
        assert prompt_positions(chunks, slot=1, prompt_length=len(later)) == 16, "only the new chunk is computed"


@pytest.mark.parametrize(
    ("stage_count", "cache_type", "choices"),
    [
        pytest.param(1, CacheType.F32, 2, id="two choices on one stage"),
        pytest.param(3, CacheType.Q8_0, 3, id="three choices on three stages with a q8_0 cache"),
    ],
)
def test_the_choices_of_one_request_compute_the_prompt_once_on_every_stage(
    prefix_models: dict[str, Path],
    stage_count: int,
    cache_type: CacheType,
    choices: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`n > 1` submits the prompt once per choice: the first prefills it, the others map its blocks (restored from
    its snapshot, shared with a reference count) and compute only the positions past its last whole chunk."""
    prompt = tuple(range(20, 170))  # 150 tokens: nine whole chunks (144) and 6 more
    with local_pipeline(
        prefix_models["llama"],
        SPANS[stage_count],
        context=512,  # room for every choice's copy of the shared last block
        cache_type=cache_type,
        parallel=choices,
        prefix_cache_bytes=BUDGET,
    ) as stages:
        seen = counted_steps(stages, monkeypatch)
        turns = asyncio.run(_together(stages[0].port, prefix_chunk=CHUNK, prompts=[prompt] * choices))
    assert [t.cached for t in turns] == [0] + [144] * (choices - 1)
    assert len({t.tokens for t in turns}) == 1, "greedy choices of one prompt agree"
    for chunks in seen:
        computed = [prompt_positions(chunks, slot=slot, prompt_length=len(prompt)) for slot in range(choices)]
        # Slot 0 also took the coordinator's one-position readiness probe before any request.
        assert computed == [len(prompt) + 1] + [6] * (choices - 1)
