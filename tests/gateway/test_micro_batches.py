"""Micro-batches on two real `strata stage-worker` processes: the coordinator keeps several steps of disjoint slots in
flight so both stages compute at once, and that changes nothing a client sees: the same greedy tokens and
log-probabilities as one step at a time, cancellation that never races a step, and a next stage lost with steps in
flight failing every request at once, the pipeline serving again when the stage is back.

Bit for bit where the batches are the same: with a micro-batch per slot every step holds one slot, as when each
request runs alone, and the outputs are identical. Where the groups differ, float32 matrix products round in the
last bit differently for a different number of rows (the engine's, as when requests come and go one step at a time):
the tokens are identical and the log-probabilities agree to float32 rounding.

Overlap is shown without timing: with stage 1 frozen (SIGSTOP), stage 0 still computes and sends on as many steps as
the coordinator keeps in flight, which its load status counts (steps_in_flight); one step at a time never has two.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import pytest
from grpc import aio
from strata.gateway.errors import GatewayError, NotReadyError
from strata.gateway.generation import Generation, Sampling, Token
from strata.gateway.local import StageProcess
from strata.gateway.metrics import GatewayMetrics
from strata.gateway.pipeline import Pipeline
from strata.lease import FencingToken
from strata.rpc.v1 import stage_pb2, stage_pb2_grpc

SPANS = ((0, 2), (2, 4))  # the four-layer qwen2 model, two layers a stage
SLOTS = 4
CONTEXT = 512
PREFILL_CHUNK = 8  # short, so the long prompts prefill over several steps while the short ones already decode
TERMS = itertools.count(1)  # the stages keep the highest term they accepted: every coordinator here takes a newer one


def next_fence(holder: str = "micro-batch-test") -> FencingToken:
    return FencingToken(lease_uid="lease", term=next(TERMS), holder=holder)


@dataclass(frozen=True)
class Ask:
    prompt: tuple[int, ...]
    max_tokens: int
    logprobs: int = 0


# Four requests at once: a prompt of one chunk and ones of two, three and five chunks, generating different lengths.
ASKS = (
    Ask(prompt=tuple(range(3, 8)), max_tokens=14),
    Ask(prompt=tuple(range(20, 43)), max_tokens=6, logprobs=3),
    Ask(prompt=tuple(range(60, 100)), max_tokens=10),
    Ask(prompt=tuple(range(110, 121)), max_tokens=18),
)


@dataclass(frozen=True)
class Output:
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...]


Outputs = list["Output | GatewayError"]
ROUNDING = 1e-5  # measured: one float32 ulp (4.8e-7) at these log-probabilities; 20x that leaves room, no more


def assert_same(ours: Outputs, theirs: Outputs, *, exact: bool) -> None:
    if exact:
        assert ours == theirs
        return
    assert all(isinstance(o, Output) for o in (*ours, *theirs)), (ours, theirs)
    mine = [o for o in ours if isinstance(o, Output)]
    other = [o for o in theirs if isinstance(o, Output)]
    assert [o.tokens for o in mine] == [o.tokens for o in other]
    assert [[t for t, _ in step] for o in mine for step in o.top_logprobs] == [
        [t for t, _ in step] for o in other for step in o.top_logprobs
    ]
    for a, b in zip(mine, other, strict=True):
        values_a = [*a.logprobs, *(p for step in a.top_logprobs for _, p in step)]
        values_b = [*b.logprobs, *(p for step in b.top_logprobs for _, p in step)]
        assert max((abs(x - y) for x, y in zip(values_a, values_b, strict=True)), default=0.0) <= ROUNDING


class Stages:
    """Two stage worker processes, last first; stage 1 can be frozen, killed and started again on its port."""

    def __init__(self, model: Path, folder: Path) -> None:
        self.model, self.folder = model, folder
        self.last = self._start(1, listen="127.0.0.1:0", next_stage="")
        self.last_port = self.last.port
        self.first = self._start(0, listen="127.0.0.1:0", next_stage=f"127.0.0.1:{self.last_port}")

    def _start(self, index: int, *, listen: str, next_stage: str) -> StageProcess:
        start, end = SPANS[index]
        env = {
            "STRATA_STAGE_INDEX": str(index),
            "STRATA_LAYER_START": str(start),
            "STRATA_LAYER_END": str(end),
            "STRATA_MODEL_URL": str(self.model),
            "STRATA_CONTEXT": str(CONTEXT),
            "STRATA_PARALLEL": str(SLOTS),
            "STRATA_CACHE_TYPE_K": "f32",
            "STRATA_CACHE_TYPE_V": "f32",
            "STRATA_NEXT_STAGE": next_stage,
            "STRATA_LISTEN": listen,
        }
        return StageProcess(env=env, log_path=self.folder / f"stage-{index}.log")

    def restart_last(self) -> None:
        self.last.stop(grace_s=0)
        self.last = self._start(1, listen=f"127.0.0.1:{self.last_port}", next_stage="")

    def stop(self) -> None:
        self.first.stop()
        self.last.stop()


@pytest.fixture(scope="module")
def stages(qwen2_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stages]:
    running = Stages(qwen2_model, tmp_path_factory.mktemp("micro-batch-stages"))
    try:
        yield running
    finally:
        running.stop()


@contextmanager
def frozen(stage: StageProcess) -> Iterator[None]:
    stage.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        with suppress(ProcessLookupError):  # killed while frozen
            stage.send_signal(signal.SIGCONT)


async def load_status(port: int) -> stage_pb2.LoadStatus:
    async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        status: stage_pb2.LoadStatus = await stage_pb2_grpc.StageStub(channel).GetLoadStatus(
            stage_pb2.LoadStatusRequest(), timeout=10
        )
        return status


async def until(probe: Callable[[], Awaitable[bool]], *, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        await asyncio.sleep(0.05)


class Driver:
    """The gateway's coordinator in this process, on the stage processes."""

    def __init__(self, stages: Stages, *, micro_batches: int) -> None:
        self.ready = asyncio.Event()
        self.metrics = GatewayMetrics()
        self.pipeline = Pipeline(
            first_stage=f"127.0.0.1:{stages.first.port}",
            slots=SLOTS,
            context=CONTEXT,
            fence=next_fence(),
            prefill_chunk=PREFILL_CHUNK,
            micro_batches=micro_batches,
            metrics=self.metrics,
            step_timeout_s=30,
            probe_interval_s=0.05,
            on_ready_change=lambda now: self.ready.set() if now else self.ready.clear(),
        )
        self.freed: dict[int, asyncio.Event] = {}

    async def __aenter__(self) -> Driver:
        await self.pipeline.start()
        await asyncio.wait_for(self.ready.wait(), timeout=90)
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.pipeline.close()

    def submit(self, slot: int, ask: Ask) -> Generation:
        self.freed[slot] = asyncio.Event()
        return self.pipeline.submit(
            slot=slot,
            prompt=ask.prompt,
            max_tokens=ask.max_tokens,
            sampling=Sampling(temperature=0.0, logprobs=ask.logprobs),
            stop_ids=frozenset(),
            on_freed=self.freed[slot].set,
        )

    def steps_in_flight(self) -> float:
        value = self.metrics.registry.get_sample_value("strata_gateway_steps_in_flight", {"pipeline": "0"})
        assert value is not None, "the gauge is exported"
        return value


async def collect(generation: Generation) -> Output | GatewayError:
    tokens: list[Token] = []
    try:
        async for event in generation.stream():
            if isinstance(event, Token):
                tokens.append(event)
    except GatewayError as error:
        return error
    return Output(
        tokens=tuple(t.token_id for t in tokens),
        logprobs=tuple(t.logprob for t in tokens),
        top_logprobs=tuple(t.top_logprobs for t in tokens),
    )


async def generate_all(driver: Driver, asks: tuple[Ask, ...] = ASKS) -> Outputs:
    generations = [driver.submit(slot, ask) for slot, ask in enumerate(asks)]
    return list(await asyncio.gather(*(collect(g) for g in generations)))


async def one_step_at_a_time(stages: Stages) -> Outputs:
    async with Driver(stages, micro_batches=1) as driver:
        return await generate_all(driver)


async def each_alone(stages: Stages) -> Outputs:
    async with Driver(stages, micro_batches=1) as driver:
        return [await collect(driver.submit(slot, ask)) for slot, ask in enumerate(ASKS)]


@pytest.fixture(scope="module")
def reference(stages: Stages) -> Outputs:
    """The four requests at once, one step of every slot at a time."""
    outputs = asyncio.run(one_step_at_a_time(stages))
    assert all(isinstance(o, Output) for o in outputs), outputs
    assert [len(o.tokens) for o in outputs if isinstance(o, Output)] == [a.max_tokens for a in ASKS]
    return outputs


@pytest.fixture(scope="module")
def alone(stages: Stages) -> Outputs:
    """Each request on its own, one after the other: every step holds its slot only."""
    return asyncio.run(each_alone(stages))


@pytest.mark.parametrize(
    ("micro_batches", "compare_with", "exact"),
    [
        pytest.param(
            4, "alone", True, id="a micro-batch per slot gives exactly what each request gives alone, bit for bit"
        ),
        pytest.param(
            2, "reference", False, id="two micro-batches give the same tokens as one step at a time, logprobs too"
        ),
        pytest.param(
            3, "reference", False, id="three micro-batches of uneven groups give the same tokens and logprobs"
        ),
    ],
)
def test_micro_batches_change_no_output(
    stages: Stages, request: pytest.FixtureRequest, micro_batches: int, compare_with: str, exact: bool
) -> None:
    async def scenario() -> Outputs:
        async with Driver(stages, micro_batches=micro_batches) as driver:
            return await generate_all(driver)

    outputs = asyncio.run(scenario())
    assert_same(outputs, request.getfixturevalue(compare_with), exact=exact)


def test_one_micro_batch_is_one_step_at_a_time_bit_for_bit(stages: Stages, reference: Outputs) -> None:
    assert asyncio.run(one_step_at_a_time(stages)) == reference


@pytest.mark.parametrize(
    ("micro_batches", "in_flight"),
    [
        pytest.param(1, 1, id="one step at a time leaves stage 0 idle while stage 1 works"),
        pytest.param(2, 2, id="with two micro-batches stage 0 computes the next step while stage 1 holds one"),
        pytest.param(3, 3, id="with three micro-batches three steps are in flight at once"),
    ],
)
def test_stage_0_works_ahead_of_stage_1(stages: Stages, reference: Outputs, micro_batches: int, in_flight: int) -> None:
    async def scenario() -> Outputs:
        async with Driver(stages, micro_batches=micro_batches) as driver:
            with frozen(stages.last):
                running = asyncio.ensure_future(generate_all(driver))

                async def stage_0_holds_them() -> bool:
                    status = await load_status(stages.first.port)
                    return status.steps_in_flight == in_flight and driver.steps_in_flight() == in_flight

                # Stage 1 answers nothing while frozen: every step the coordinator wrote has been computed by
                # stage 0 and sent on, so stage 0 counts exactly as many as the coordinator keeps in flight.
                await until(stage_0_holds_them, what=f"stage 0 to hold {in_flight} steps sent on", timeout_s=10)
                assert (await load_status(stages.first.port)).has_next_stage
            return await running

    assert_same(asyncio.run(scenario()), reference, exact=micro_batches == 1)


def test_a_cancelled_request_frees_its_slot_between_its_steps_and_the_others_run_on(
    stages: Stages, reference: Outputs, alone: Outputs
) -> None:
    """Cancelling while the slot's next step is in flight: its reset waits for that step (a reset that overtook it
    would leave a gap in the slot on stage 1, which refuses the step and fails every request)."""

    async def scenario() -> tuple[Outputs, Output | GatewayError]:
        async with Driver(stages, micro_batches=2) as driver:
            generations = [driver.submit(slot, ask) for slot, ask in enumerate(ASKS)]
            others = asyncio.gather(*(collect(g) for g in generations[1:]))
            seen = 0
            async for event in generations[0].stream():
                seen += isinstance(event, Token)
                if seen == 3:
                    # The driver wrote the slot's next step before this consumer ran again.
                    assert generations[0].in_flight, "the slot has a step in flight"
                    driver.pipeline.cancel(generations[0])
                    break
            await asyncio.wait_for(driver.freed[0].wait(), timeout=30)
            outputs = list(await others)
            again = await collect(driver.submit(0, ASKS[0]))  # the freed slot serves a new request exactly
            return outputs, again

    outputs, again = asyncio.run(scenario())
    assert_same(outputs, reference[1:], exact=False)
    assert again == alone[0], "alone on a reset slot: bit for bit what the request gives alone"


def test_a_next_stage_killed_with_steps_in_flight_fails_them_all_and_the_pipeline_recovers(
    stages: Stages, reference: Outputs
) -> None:
    async def scenario() -> tuple[Outputs, Outputs]:
        async with Driver(stages, micro_batches=2) as driver:
            with frozen(stages.last):
                running = asyncio.ensure_future(generate_all(driver))

                async def two_in_flight() -> bool:
                    return (await load_status(stages.first.port)).steps_in_flight == 2

                await until(two_in_flight, what="two steps in flight", timeout_s=10)
                stages.last.send_signal(signal.SIGKILL)
            failed = await asyncio.wait_for(running, timeout=30)
            assert not driver.pipeline.ready
            stages.restart_last()
            await asyncio.wait_for(driver.ready.wait(), timeout=90)
            return failed, await generate_all(driver)

    failed, after = asyncio.run(scenario())
    for error in failed:
        assert isinstance(error, NotReadyError), error
        assert "a pipeline stage is unavailable" in str(error)
        assert f"127.0.0.1:{stages.last_port}" in str(error), "the error names the stage that went away"
    assert_same(after, reference, exact=False)


@pytest.mark.parametrize(
    "micro_batches",
    [
        pytest.param(1, id="one step at a time"),
        pytest.param(2, id="two micro-batches"),
    ],
)
def test_stepping_down_with_steps_in_flight_fails_them_and_a_promotion_serves_again(
    stages: Stages, reference: Outputs, micro_batches: int
) -> None:
    async def scenario() -> tuple[Outputs, Outputs]:
        async with Driver(stages, micro_batches=micro_batches) as driver:
            with frozen(stages.last):
                running = asyncio.ensure_future(generate_all(driver))
                await until(lambda: asyncio.sleep(0, driver.steps_in_flight() == micro_batches), what="steps written")
                driver.pipeline.step_down("the lease was lost")
            failed = await asyncio.wait_for(running, timeout=30)
            driver.pipeline.promote(next_fence("the next coordinator"))
            await asyncio.wait_for(driver.ready.wait(), timeout=30)
            return failed, await generate_all(driver)

    failed, after = asyncio.run(scenario())
    for error in failed:
        assert isinstance(error, NotReadyError), error
        assert "no longer coordinates the pipeline: the lease was lost" in str(error)
    assert_same(after, reference, exact=micro_batches == 1)
