"""The driver's steps draft as strata.gateway.draft_lengths decides: one slot on a repeating text drafts, sixteen slots
at the prior acceptance send one position each (speculation off for the step), sixteen that keep being accepted draft
shorter than one alone, and a lane's verified runs move its estimate."""

from __future__ import annotations

import pytest
from strata.gateway.draft_lengths import PRIOR_ACCEPTANCE, Acceptance
from strata.gateway.generation import Sampling
from strata.gateway.pipeline import Pipeline
from strata.gateway.speculation import Speculation
from strata.gateway.stage_stream import Step
from strata.rpc.v1 import stage_pb2

PROMPT = (1, 2, 3, 4, 5) * 8  # n-gram lookup always has a continuation to propose


def decoding_pipeline(slots: int, *, accepted_runs: int) -> Pipeline:
    """A driver (not started) whose `slots` generations have prefilled, each lane having had `accepted_runs` drafts of
    four with three accepted (a rate of about three in four)."""
    pipeline = Pipeline(first_stage="127.0.0.1:1", slots=slots, context=4096, fence=None, speculation=Speculation())
    pipeline._ready = True
    for slot in range(slots):
        g = pipeline.submit(
            slot=slot, prompt=PROMPT, max_tokens=64, sampling=Sampling(), stop_ids=frozenset(), on_freed=lambda: None
        )
        g.fed, g.last_token = len(PROMPT), PROMPT[-1]
        for _ in range(accepted_runs):
            g.acceptance.observe(drafted=4, accepted=3)
    return pipeline


CASES = {
    "one slot at the prior drafts two: a third token, a one-in-eight chance, does not pay for its position": (1, 0, 2),
    "sixteen slots at the prior draft nothing": (16, 0, 0),
    "sixteen slots accepting three in four draft one token, shorter than one alone": (16, 12, 1),
    "one slot accepting three in four drafts the most": (1, 12, 4),
}


@pytest.mark.parametrize(("slots", "accepted_runs", "drafted"), CASES.values(), ids=CASES.keys())
def test_a_steps_drafts_follow_the_batch_and_the_lanes_acceptance(slots: int, accepted_runs: int, drafted: int) -> None:
    pipeline = decoding_pipeline(slots, accepted_runs=accepted_runs)
    chunks = pipeline._chunks()
    assert len(chunks) == slots
    assert [c.drafted for c in chunks] == [drafted] * slots
    assert all(c.length == 1 + c.drafted for c in chunks)
    off = pipeline.metrics.registry.get_sample_value("strata_gateway_speculative_off_steps_total")
    assert off == (1.0 if drafted == 0 else 0.0), "a step with speculation off is counted"


def test_a_verified_run_updates_its_lanes_acceptance() -> None:
    pipeline = decoding_pipeline(1, accepted_runs=0)
    (chunk,) = pipeline._chunks()
    g = pipeline._active[0]
    g.in_flight = chunk.length
    before = g.acceptance.rate
    reply = stage_pb2.ForwardReply(
        step_id=1, tokens=[stage_pb2.SampledToken(slot=0, token_id=t) for t in (1, 2, 9)]
    )  # two drafts accepted, the third rejected
    pipeline._dispatch(Step(step_id=1, chunks=[chunk]), reply)
    expected = Acceptance()
    expected.observe(drafted=chunk.drafted, accepted=2)
    assert g.acceptance.rate == expected.rate != before
    assert g.fed == len(PROMPT) + 3
    counted = pipeline.metrics.registry.get_sample_value
    assert (counted("strata_gateway_steps_total"), counted("strata_gateway_step_positions_total")) == (
        1.0,
        chunk.length,
    ), "the step and the positions it carried are counted"


SHADOWS = {"the step picked the n-gram guess: the rate rises": (1, True), "it picked another: it falls": (9, False)}


@pytest.mark.parametrize(("picked", "rises"), SHADOWS.values(), ids=SHADOWS.keys())
def test_a_lane_that_sent_no_draft_still_learns_whether_its_guess_was_right(picked: int, rises: bool) -> None:
    pipeline = decoding_pipeline(16, accepted_runs=0)
    chunks = pipeline._chunks()
    assert all(c.drafted == 0 for c in chunks), "a full batch at the prior drafts nothing"
    for c in chunks:
        pipeline._active[c.slot].in_flight = c.length
    reply = stage_pb2.ForwardReply(
        step_id=1, tokens=[stage_pb2.SampledToken(slot=c.slot, token_id=picked) for c in chunks]
    )
    pipeline._dispatch(Step(step_id=1, chunks=chunks), reply)
    rates = {pipeline._active[c.slot].acceptance.rate for c in chunks}
    assert len(rates) == 1
    assert (rates.pop() > PRIOR_ACCEPTANCE) is rises
    assert all(g.shadow is None for g in pipeline._active.values()), "a guess serves its own step only"


class TimedDrafter:
    """A drafter that computes (a draft model), whose tokens cost `token_seconds` each to make and whose next
    proposal costs `start_seconds` more before its first (a feed of what its slot lacks)."""

    computes = True
    shared = None

    def __init__(self, token_seconds: float, start_seconds: float = 0.0) -> None:
        self.token_seconds = token_seconds
        self.start_seconds = start_seconds

    def extend(self, tokens: object) -> None:
        pass

    def propose(self, limit: int) -> tuple[int, ...]:
        return (1,) * limit

    def close(self) -> None:
        pass


# (token seconds, start seconds, whether a one-position step has been timed, proposal already made, budget). A
# one-position step of the pipeline takes 10 ms once timed; the request may take 64 more, its start spread over 32.
DRAFT_COSTS = {
    "a draft a tenth of a pipeline step drafts": (0.001, 0.0, True, None, 4),
    "a draft as dear as a pipeline step does not": (0.01, 0.0, True, None, 0),
    "a cheap draft whose prompt's feed takes 3 steps drafts: the feed serves the rest": (0.001, 0.03, True, None, 4),
    "one whose feed takes 100 steps does not": (0.001, 1.0, True, None, 0),
    "nothing to price it against before a step is timed: no draft": (0.001, 0.0, False, None, 0),
    "a proposal already made costs nothing more, however dear": (0.01, 1.0, True, (1, 1, 1, 1), 4),
}


@pytest.mark.parametrize(
    ("token_seconds", "start_seconds", "timed", "proposed", "budget"), DRAFT_COSTS.values(), ids=DRAFT_COSTS.keys()
)
def test_a_draft_models_measured_cost_counts_against_its_drafts(
    token_seconds: float, start_seconds: float, timed: bool, proposed: tuple[int, ...] | None, budget: int
) -> None:
    now = [0.0]
    pipeline = Pipeline(
        first_stage="127.0.0.1:1", slots=1, context=4096, fence=None, speculation=Speculation(),
        drafters=lambda prompt: TimedDrafter(token_seconds, start_seconds), clock=lambda: now[0],
    )  # fmt: skip
    pipeline._ready = True
    g = pipeline.submit(
        slot=0, prompt=PROMPT, max_tokens=64, sampling=Sampling(), stop_ids=frozenset(), on_freed=lambda: None
    )
    for _ in range(8):  # accepted whole: only the draft's cost can stop it
        g.acceptance.observe(drafted=4, accepted=4)
    g.fed, g.last_token, g.proposed = len(PROMPT), PROMPT[-1], proposed
    if timed:
        # A one-position step landing 10 ms after it was written: a one-position step costs 10 ms.
        step = Step(step_id=1, chunks=[stage_pb2.SlotChunk(slot=0, start_position=0, length=1)], written_at=1.0)
        now[0] = 1.01
        pipeline._time_step(step)
        assert pipeline._position_seconds == pytest.approx(0.01)
        prefill = Step(step_id=2, chunks=[stage_pb2.SlotChunk(slot=0, start_position=0, length=64)], written_at=1.0)
        now[0] = 2.0
        pipeline._time_step(prefill)
        assert pipeline._position_seconds == pytest.approx(0.01), "a prefill step is not a decode step's measure"
    assert pipeline._draft_budgets([g]) == {0: budget}
