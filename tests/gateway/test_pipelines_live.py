"""Two real pipelines of one stage each behind one gateway: routing, chat affinity, and losing one pipeline.

The stages are real stage workers on the CPU in this process (strata_testbed.pipelines), the gateway the real app
that `strata gateway` serves, driving both pipelines through strata.gateway.pipelines. Which pipeline served a
request shows in the per-pipeline metrics, as it would to an autoscaler. Every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from strata.gateway.pipelines import PipelineEntry
from strata.gateway.server import build
from strata.gateway.serving import Serving
from strata.gateway.settings import GatewaySettings
from strata.gguf.header import GGUFHeader
from strata.stage_worker.server import RunningStage
from strata_testbed.pipelines import local_pipeline

CONTEXT = 1024
LANES = 2
CHUNK = 16  # prefix-cache chunk: a chat's first turn already spans one
DEADLINE_S = 120.0
T = TypeVar("T")


@pytest.fixture(scope="module")
def stage_sets(qwen2_model: Path) -> Iterator[list[list[RunningStage]]]:
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(
                local_pipeline(qwen2_model, [(0, 4)], context=CONTEXT, parallel=LANES, prefix_cache_bytes=64 << 20)
            )
            for _ in range(2)
        ]


def entries(stage_sets: list[list[RunningStage]]) -> list[PipelineEntry]:
    return [
        PipelineEntry(index=i, generation=0, first_stage=f"127.0.0.1:{s[0].port}", parallel=LANES, context=CONTEXT)
        for i, s in enumerate(stage_sets)
    ]


def gateway(model: Path, header: GGUFHeader, first_stage: str) -> tuple[Any, Serving]:
    settings = GatewaySettings(
        model_url=str(model),
        model_name="any",
        first_stage=first_stage,
        context=CONTEXT,
        parallel=LANES,
        prefix_cache_chunk=CHUNK,
    )
    return build(settings, header=header)


def served_by(serving: Serving) -> dict[int, float]:
    """Tokens each pipeline generated so far, from the metrics an autoscaler reads."""
    registry = serving.metrics.registry
    return {
        i: registry.get_sample_value("strata_gateway_pipeline_tokens_generated_total", {"pipeline": str(i)}) or 0.0
        for i in (0, 1)
    }


async def until(probe: Callable[[], bool], *, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(0.02)


def run(scenario: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(asyncio.wait_for(scenario(), timeout=DEADLINE_S))


@contextlib.asynccontextmanager
async def started(serving: Serving, app: Any, stage_sets: list[list[RunningStage]]) -> Any:
    await serving.pipelines.start(entries(stage_sets))
    try:
        await until(lambda: all(d.ready for d in serving.pipelines.drivers.values()), what="both pipelines ready")
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=60) as http:
            yield http
    finally:
        await serving.pipelines.close()


def chat(messages: list[dict[str, str]], **extra: object) -> dict[str, object]:
    return {"model": "any", "messages": messages, "max_tokens": 4, "temperature": 0} | extra


def system(number: int) -> dict[str, str]:
    return {"role": "system", "content": f"You are assistant number {number}. Answer briefly and kindly, always."}


def test_traffic_reaches_both_pipelines_and_each_chat_keeps_to_one(
    qwen2_model: Path, qwen2_header: GGUFHeader, stage_sets: list[list[RunningStage]]
) -> None:
    app, serving = gateway(qwen2_model, qwen2_header, f"127.0.0.1:{stage_sets[0][0].port}")

    async def scenario() -> None:
        async with started(serving, app, stage_sets) as http:
            assert (await http.get("/readyz")).status_code == 200
            hits_before = {
                i: serving.metrics.registry.get_sample_value(
                    "strata_gateway_prefix_cache_hits_total", {"pipeline": str(i)}
                )
                or 0.0
                for i in (0, 1)
            }
            first_turns = [[system(n), {"role": "user", "content": f"Tell me about topic {n}."}] for n in range(8)]
            # All at once: four lanes in all, so both pipelines take some, and the rest wait their turn.
            replies = await asyncio.gather(*(http.post("/v1/chat/completions", json=chat(m)) for m in first_turns))
            assert [r.status_code for r in replies] == [200] * len(replies)
            assert all(v > 0 for v in served_by(serving).values()), f"both pipelines served: {served_by(serving)}"

            homes = []
            for messages, reply in zip(first_turns, replies, strict=True):
                answer = reply.json()["choices"][0]["message"]["content"] or "ok"
                turns = []
                for question in ("And then?", "Why so?"):
                    messages = [*messages, {"role": "assistant", "content": answer}]
                    messages.append({"role": "user", "content": question})
                    before = served_by(serving)
                    later = await http.post("/v1/chat/completions", json=chat(messages))
                    assert later.status_code == 200
                    after = served_by(serving)
                    grew = [i for i in (0, 1) if after[i] > before[i]]
                    assert len(grew) == 1, "one pipeline served the turn"
                    turns.append(grew[0])
                    answer = later.json()["choices"][0]["message"]["content"] or "ok"
                assert turns[0] == turns[1], f"a chat's later turns land on one pipeline: {turns}"
                homes.append(turns[0])
            assert set(homes) == {0, 1}, f"different chats spread over both pipelines: {homes}"
            hits = {
                i: serving.metrics.registry.get_sample_value(
                    "strata_gateway_prefix_cache_hits_total", {"pipeline": str(i)}
                )
                or 0.0
                for i in (0, 1)
            }
            # Each chat's third turn restores what its second saved, on the pipeline where both ran.
            assert sum(hits.values()) - sum(hits_before.values()) >= len(first_turns)

    run(scenario)


def test_losing_one_pipeline_fails_only_its_requests_with_a_retryable_503_and_the_other_serves_on(
    qwen2_model: Path, qwen2_header: GGUFHeader, tmp_path: Path
) -> None:
    with contextlib.ExitStack() as stack:
        sets = [
            stack.enter_context(local_pipeline(qwen2_model, [(0, 4)], context=CONTEXT, parallel=LANES))
            for _ in range(2)
        ]
        app, serving = gateway(qwen2_model, qwen2_header, f"127.0.0.1:{sets[0][0].port}")
        # Never the end-of-text token: the long requests run until they are stopped or fail.
        no_end = {str(t): -100 for t in serving.tokenizer.stop_ids}

        async def scenario() -> None:
            async with started(serving, app, sets) as http:
                long = {"model": "any", "max_tokens": 600, "temperature": 0, "logit_bias": no_end}
                running = [
                    asyncio.create_task(http.post("/v1/completions", json=long | {"prompt": f"Story {n}:"}))
                    for n in range(2 * LANES)
                ]
                figures = serving.pipelines.figures
                await until(
                    lambda: all(f.busy == LANES and f.tokens > 0 for f in figures()), what="every lane generating"
                )
                sets[1][0].stop(0)  # pipeline 1's only stage goes away mid-generation
                results = await asyncio.gather(*running)
                failed = [r for r in results if r.status_code != 200]
                assert len(failed) == LANES, "exactly the lost pipeline's requests fail"
                for response in failed:
                    assert response.status_code == 503
                    assert response.headers["retry-after"] == "1"
                    assert response.json()["error"]["code"] == "service_unavailable"
                assert serving.admission.lanes == LANES, "the lost pipeline's lanes left the capacity"
                assert (await http.get("/readyz")).status_code == 200, "ready while one pipeline serves"
                before = served_by(serving)
                after_loss = [
                    await http.post("/v1/completions", json={"model": "any", "prompt": f"Next {n}", "max_tokens": 3})
                    for n in range(4)
                ]
                assert [r.status_code for r in after_loss] == [200] * 4, "new requests go to the pipeline left"
                assert served_by(serving)[1] == before[1]
                assert served_by(serving)[0] > before[0]

        run(scenario)
