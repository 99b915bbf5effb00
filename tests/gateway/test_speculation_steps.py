"""The driver's steps draft as strata.gateway.draft_lengths decides: one slot on a repeating text drafts, sixteen slots
at the prior acceptance send one position each (speculation off for the step), sixteen that keep being accepted draft
shorter than one alone, and a lane's verified runs move its estimate."""

from __future__ import annotations

import pytest
from strata.gateway.draft_lengths import Acceptance
from strata.gateway.generation import Sampling
from strata.gateway.pipeline import Pipeline
from strata.gateway.speculation import Speculation
from strata.gateway.stage_stream import Step
from strata.rpc.v1 import stage_pb2

PROMPT = (1, 2, 3, 4, 5) * 8  # n-gram lookup always has a continuation to propose


def decoding_pipeline(slots: int, *, accepted_runs: int) -> Pipeline:
    """A driver (not started) whose `slots` generations have prefilled, each lane having had `accepted_runs` drafts of
    four accepted whole."""
    pipeline = Pipeline(first_stage="127.0.0.1:1", slots=slots, context=4096, fence=None, speculation=Speculation())
    pipeline._ready = True
    for slot in range(slots):
        g = pipeline.submit(
            slot=slot, prompt=PROMPT, max_tokens=64, sampling=Sampling(), stop_ids=frozenset(), on_freed=lambda: None
        )
        g.fed, g.last_token = len(PROMPT), PROMPT[-1]
        for _ in range(accepted_runs):
            g.acceptance.observe(drafted=4, accepted=4)
    return pipeline


CASES = {
    "one slot at the prior drafts two: a third token, a one-in-eight chance, does not pay for its position": (1, 0, 2),
    "sixteen slots at the prior draft nothing": (16, 0, 0),
    "sixteen slots whose drafts keep being accepted draft shorter than one alone": (16, 12, 3),
    "one slot whose drafts keep being accepted drafts the most": (1, 12, 4),
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
