"""Speculation's pure parts: what n-gram lookup proposes, which drafts the last stage accepts, and the bounds and
requests it applies to."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from strata.gateway.settings import GatewaySettings, from_environment
from strata.gateway.speculation import DraftSource, NgramDrafter, Speculation, drafts_for
from strata.stage_worker.picks import accept
from strata.stage_worker.sampling import Sampled


@dataclass(frozen=True)
class Lookup:
    tokens: tuple[int, ...]
    limit: int
    proposed: tuple[int, ...]
    speculation: Speculation = field(default_factory=Speculation)
    added: tuple[int, ...] = ()  # extended after construction, as the driver does with each picked token


LOOKUPS = {
    "what followed the suffix's earlier occurrence": Lookup((1, 2, 3, 4, 9, 1, 2, 3), 4, (4, 9, 1, 2)),
    "no more than the limit": Lookup((1, 2, 3, 4, 9, 1, 2, 3), 2, (4, 9)),
    "no more than max draft": Lookup((1, 2, 3, 4, 5, 6, 7, 1), 9, (2, 3), Speculation(max_draft=2)),
    "the latest earlier occurrence": Lookup((5, 1, 7, 5, 1, 8, 5, 1), 2, (8, 5)),
    "the longest suffix seen before, not the latest short one": Lookup((7, 8, 9, 1, 4, 9, 1, 6, 7, 8, 9, 1), 1, (4,)),
    "a continuation that reaches the end goes on with its period": Lookup((3, 4, 5, 3), 5, (4, 5, 3, 4)),
    "a repeated token goes on repeating": Lookup((7, 2, 2, 2), 3, (2, 2, 2)),
    "nothing when the suffix is new": Lookup((1, 2, 3, 4), 4, ()),
    "the minimum draft when the limit allows it": Lookup((3, 4, 5, 3), 2, (4, 5), Speculation(min_draft=2)),
    "nothing when the limit is below the minimum": Lookup((1, 2, 1), 1, (), Speculation(min_draft=2)),
    "nothing with no room": Lookup((1, 2, 1), 0, ()),
    "n-grams shorter than the minimum are not looked up": Lookup((1, 2, 9, 2), 2, (), Speculation(ngram_min=2)),
    "tokens added later are indexed": Lookup((1, 2, 3), 3, (2, 3, 1), added=(1,)),
    "a token added later is a new follower": Lookup((1, 2, 1, 5), 1, (5,), added=(1,)),
    "the prompt before the lookback is not indexed": Lookup((1, 2, 3, 4, 1), 2, (), Speculation(lookback=4)),
    "the output is indexed beyond the lookback": Lookup((9, 9, 5, 6), 2, (6, 5), Speculation(lookback=2), (5,)),
}


@pytest.mark.parametrize("case", LOOKUPS.values(), ids=LOOKUPS.keys())
def test_ngram_lookup_proposes(case: Lookup) -> None:
    drafter = NgramDrafter(case.tokens, speculation=case.speculation)
    drafter.extend(case.added)
    assert drafter.propose(case.limit) == case.proposed


def test_a_long_context_is_looked_up_by_its_index_not_by_a_scan() -> None:
    tokens = [*range(50_000), 7, 8, 9, 10, 11, 7, 8]
    drafter = NgramDrafter(tokens, speculation=Speculation())
    assert drafter.propose(3) == (9, 10, 11)


def picks(*tokens: int) -> list[Sampled]:
    return [Sampled(token_id=t, logprob=-0.5, top_logprobs=()) for t in tokens]


ACCEPTS = {
    "every draft matches: all of them and the pick after the last": (picks(4, 5, 6), (4, 5), (4, 5, 6)),
    "the first draft differs: the model's own pick alone": (picks(9, 5, 6), (4, 5), (9,)),
    "a later draft differs: the matching ones and the model's pick there": (picks(4, 9, 6), (4, 5), (4, 9)),
    "a pick after a rejected draft never counts, even if it equals the next draft": (picks(4, 9, 5), (4, 5), (4, 9)),
}


@pytest.mark.parametrize(("chosen", "draft", "kept"), ACCEPTS.values(), ids=ACCEPTS.keys())
def test_the_last_stage_accepts_the_drafts_its_own_picks_match(
    chosen: list[Sampled], draft: tuple[int, ...], kept: tuple[int, ...]
) -> None:
    assert tuple(s.token_id for s in accept(chosen, draft)) == kept


BAD_BOUNDS = {
    "min draft of 0": {"min_draft": 0},
    "min draft above max": {"min_draft": 5, "max_draft": 4},
    "n-gram min of 0": {"ngram_min": 0},
    "n-gram min above max": {"ngram_min": 3, "ngram_max": 2},
    "a negative position cost": {"position_cost": -0.1},
    "a position dearer than a step": {"position_cost": 1.5},
    "no lookback": {"lookback": 0},
    "a probability floor above 1": {"p_min": 1.5},
    "a negative probability floor": {"p_min": -0.1},
}


@pytest.mark.parametrize("bounds", BAD_BOUNDS.values(), ids=BAD_BOUNDS.keys())
def test_bounds_out_of_range_are_refused(bounds: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="speculation needs"):
        Speculation(**bounds)  # type: ignore[arg-type]


REQUESTS = {
    "greedy, sampled or under a grammar (each drafted pick takes its own mask)": ({"penalised": False}, True),
    "penalised": ({"penalised": True}, False),
}


@pytest.mark.parametrize(("request_kind", "drafts"), REQUESTS.values(), ids=REQUESTS.keys())
def test_only_requests_whose_picks_depend_on_their_own_logits_and_masks_are_drafted(
    request_kind: dict[str, object], drafts: bool
) -> None:
    assert drafts_for(**request_kind) is drafts  # type: ignore[arg-type]


SETTINGS = {
    "an unknown method": ({"speculative": "eagle"}, "not one of: ngram, draft"),
    "draft bounds without speculation": ({"max_draft": 8}, "speculative decoding, which is off"),
    "a position cost without speculation": ({"position_cost": 0.5}, "a position cost apply to speculative decoding"),
    "a position cost above a step's": ({"speculative": "ngram", "position_cost": 1.5}, "position cost within"),
    "a min draft above the max": ({"speculative": "ngram", "min_draft": 6}, "speculation needs"),
    "the draft method without a draft model": ({"speculative": "draft"}, "method draft needs the draft model's file"),
    "a draft model with the n-gram method": (
        {"speculative": "ngram", "draft_model": "d.gguf"},
        "a draft model apply to speculative decoding method draft only, not with method ngram",
    ),
    "a draft model without speculation": ({"draft_model": "d.gguf"}, "not with speculative decoding off"),
    "a probability floor with the n-gram method": (
        {"speculative": "ngram", "p_min": 0.5},
        "a draft probability floor \\(p min\\) apply to speculative decoding method draft only",
    ),
    "a draft device without a draft": ({"draft_device": "cuda"}, "a draft device apply"),
    "a probability floor above 1": (
        {"speculative": "draft", "draft_model": "d.gguf", "p_min": 2.0},
        "probability floor \\(p min\\) within \\[0, 1\\]",
    ),
}


@pytest.mark.parametrize(("values", "message"), SETTINGS.values(), ids=SETTINGS.keys())
def test_the_gateway_refuses_speculation_settings_it_would_not_honour(values: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GatewaySettings(model_url="m.gguf", first_stage="127.0.0.1:1", context=64, **values)  # type: ignore[arg-type]


def test_the_gateway_builds_its_speculation_from_its_settings() -> None:
    settings = GatewaySettings(
        model_url="m.gguf", first_stage="127.0.0.1:1", context=64, speculative="ngram", max_draft=6, min_draft=2
    )
    assert settings.speculation() == Speculation(max_draft=6, min_draft=2)
    assert GatewaySettings(model_url="m.gguf", first_stage="127.0.0.1:1", context=64).speculation() is None


def test_the_gateway_builds_its_draft_source_from_its_settings_and_environment() -> None:
    environ = {
        "STRATA_MODEL_URL": "m.gguf", "STRATA_FIRST_STAGE": "127.0.0.1:1", "STRATA_CONTEXT": "64",
        "STRATA_SPECULATIVE": "draft", "STRATA_DRAFT_MODEL_URL": "hf://org/repo/d.gguf", "STRATA_P_MIN": "0.5",
        "STRATA_DRAFT_MODEL_TOKEN": "secret", "STRATA_POSITION_COST": "0.25",
    }  # fmt: skip
    settings = from_environment({}, environ)
    assert settings.speculation() == Speculation(p_min=0.5, position_cost=0.25)
    assert settings.draft_source() == DraftSource(url="hf://org/repo/d.gguf", token="secret", device="cpu")
    ngram = GatewaySettings(model_url="m.gguf", first_stage="127.0.0.1:1", context=64, speculative="ngram")
    assert ngram.draft_source() is None
