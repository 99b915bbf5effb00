"""Sampling inside an allowed-token mask: every pick stays inside it, greedy or drawn, and log-probabilities stay
the model's own."""

from __future__ import annotations

import pytest
import torch
from strata.stage_worker.errors import NonFiniteLogitsError
from strata.stage_worker.sampling import NoTokenAllowedError, Sampling, allowed_tokens, sample, sample_rows

VOCAB = 50


def bitmask(allowed: set[int], *, vocab: int = VOCAB) -> bytes:
    words = [0] * ((vocab + 31) // 32)
    for token in allowed:
        words[token // 32] |= 1 << (token % 32)
    return b"".join(w.to_bytes(4, "little") for w in words)


@pytest.mark.parametrize(
    "allowed",
    [
        pytest.param({7}, id="a single token"),
        pytest.param({0, 31, 32, 49}, id="tokens on both sides of a word boundary"),
        pytest.param(set(range(0, VOCAB, 3)), id="every third token"),
    ],
)
def test_the_mask_unpacks_to_exactly_the_allowed_tokens(allowed: set[int]) -> None:
    mask = allowed_tokens(bitmask(allowed), vocab=VOCAB, device=torch.device("cpu"))
    assert set(torch.nonzero(mask).flatten().tolist()) == allowed


@pytest.mark.parametrize(
    "params",
    [
        pytest.param(Sampling(temperature=0.0), id="greedy"),
        pytest.param(Sampling(temperature=1.0), id="temperature 1"),
        pytest.param(Sampling(temperature=1.5, top_p=0.5), id="top-p"),
        pytest.param(Sampling(temperature=0.8, top_k=3), id="top-k smaller than the allowed set"),
    ],
)
def test_every_pick_is_allowed_even_where_the_model_prefers_others(params: Sampling) -> None:
    allowed = {3, 17, 40}
    logits = torch.zeros(VOCAB)
    logits[[0, 1, 2]] = 20.0  # the model's favourites, all disallowed
    logits[17] = 1.0
    picks = set()
    for seed in range(40):
        masked = Sampling(**{**params.__dict__, "seed": seed, "allowed": bitmask(allowed)})
        picks.add(sample(logits, params=masked, position=5).token_id)
    assert picks <= allowed
    if params.temperature == 0.0:
        assert picks == {17}


def test_log_probabilities_are_the_models_not_the_masks() -> None:
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0))
    picked = sample(logits, params=Sampling(logprobs=2, allowed=bitmask({9})), position=0)
    assert picked.token_id == 9
    assert picked.logprob == pytest.approx(float(torch.log_softmax(logits, -1)[9]))
    assert [t for t, _ in picked.top_logprobs] == torch.topk(logits, 2).indices.tolist()


@pytest.mark.parametrize(
    ("mask", "vocab"),
    [
        pytest.param(bitmask(set()), VOCAB, id="no bit set"),
        pytest.param(bitmask({60}, vocab=64), VOCAB, id="only tokens past the vocabulary"),
    ],
)
def test_a_mask_that_allows_nothing_is_refused(mask: bytes, vocab: int) -> None:
    with pytest.raises(NoTokenAllowedError):
        sample(torch.zeros(vocab), params=Sampling(allowed=mask), position=0)


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        pytest.param(Sampling(logit_bias=((4, 100.0),)), 4, id="a large bias makes a token the greedy pick"),
        pytest.param(Sampling(logit_bias=((0, -100.0),)), 1, id="a large negative bias removes the favourite"),
        pytest.param(Sampling(logit_bias=((1, 0.5), (2, 2.5))), 2, id="biases add to the logits"),
        pytest.param(
            Sampling(repetition_penalty=2.0, penalized=(0,)), 1, id="a repetition penalty halves a seen logit"
        ),
        pytest.param(
            Sampling(repetition_penalty=2.0, penalized=(0, 5)), 1, id="a negative seen logit is multiplied, not divided"
        ),
        pytest.param(Sampling(repetition_penalty=0.25, penalized=(2,)), 2, id="a penalty under 1 favours seen tokens"),
        pytest.param(
            Sampling(repetition_penalty=2.0, penalized=(0,), logit_bias=((0, 2.0),)),
            0,
            id="the bias comes after the penalty",
        ),
    ],
)
def test_a_logit_bias_moves_the_greedy_pick(params: Sampling, expected: int) -> None:
    logits = torch.zeros(VOCAB)
    logits[0], logits[1], logits[2], logits[5] = 3.0, 2.0, 1.0, -1.0
    assert sample(logits, params=params, position=0).token_id == expected


def test_min_p_keeps_only_tokens_near_the_likeliest() -> None:
    logits = torch.full((VOCAB,), -10.0)
    logits[[5, 6]] = 5.0
    logits[7] = 4.0  # e^-1 of the likeliest: kept at min_p 0.3, dropped at 0.5
    picks = {
        min_p: {sample(logits, params=Sampling(temperature=1.0, min_p=min_p, seed=s), position=0).token_id
                for s in range(200)}
        for min_p in (0.3, 0.5)
    }  # fmt: skip
    assert picks[0.3] == {5, 6, 7}
    assert picks[0.5] == {5, 6}


@pytest.mark.parametrize(
    ("bad", "params", "says"),
    [
        pytest.param(float("nan"), Sampling(temperature=1.0), "1 NaN and 0 infinite", id="NaN, sampled"),
        pytest.param(float("inf"), Sampling(), "0 NaN and 1 infinite", id="inf, greedy"),
        pytest.param(float("inf"), Sampling(temperature=0.7, top_p=0.9), "0 NaN and 1 infinite", id="inf, top-p"),
    ],
)
def test_non_finite_logits_are_named_not_sampled(bad: float, params: Sampling, says: str) -> None:
    logits = torch.zeros(50)
    logits[7] = bad
    with pytest.raises(NonFiniteLogitsError, match=f"position 12 hold {says} values of 50"):
        sample(logits, params=params, position=12)


def test_minus_infinity_only_rules_a_token_out() -> None:
    logits = torch.zeros(50)
    logits[:49] = float("-inf")
    assert sample(logits, params=Sampling(temperature=1.0), position=3).token_id == 49


# Rows that differ in everything a row may ask, for one batch: each must come out as it would alone.
MIXED_ROWS = (
    Sampling(),
    Sampling(temperature=1.0, seed=3),
    Sampling(temperature=0.7, top_k=4, seed=5, logprobs=3),
    Sampling(temperature=1.3, top_p=0.6, seed=8),
    Sampling(temperature=1.0, min_p=0.2, seed=1, logit_bias=((11, 4.0),)),
    Sampling(allowed=bitmask({2, 30, 41}), logprobs=1),
    Sampling(temperature=2.0, top_k=2, top_p=0.9, allowed=bitmask(set(range(10, 40))), seed=9),
    Sampling(repetition_penalty=1.8, penalized=(0, 3, 17, 44), logprobs=2),
)


def test_a_batch_of_rows_picks_what_each_row_picks_alone() -> None:
    logits = torch.randn(len(MIXED_ROWS), VOCAB, generator=torch.Generator().manual_seed(4)) * 3
    positions = list(range(20, 20 + len(MIXED_ROWS)))
    together = sample_rows(logits, params=MIXED_ROWS, positions=positions)
    alone = [sample(logits[i], params=p, position=positions[i]) for i, p in enumerate(MIXED_ROWS)]
    assert [s.token_id for s in together] == [s.token_id for s in alone]
    assert [s.top_logprobs for s in together] == [s.top_logprobs for s in alone]
    assert [len(s.top_logprobs) for s in together] == [p.logprobs for p in MIXED_ROWS]


@pytest.mark.parametrize(
    "params",
    [
        pytest.param(Sampling(temperature=1.0), id="temperature 1"),
        pytest.param(Sampling(temperature=0.5), id="temperature 0.5"),
        pytest.param(Sampling(temperature=1.0, top_p=0.8), id="top-p 0.8"),
        pytest.param(Sampling(temperature=1.0, top_k=3), id="top-k 3"),
    ],
)
def test_draws_follow_the_distribution_they_are_asked_for(params: Sampling) -> None:
    """4,000 draws (one per position) against the target: softmax of logits / T, cut to the top-k tokens or the
    smallest set holding top_p of the mass, renormalised; every count within 5 standard deviations."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, float("-inf"), -3.0])
    target = torch.softmax(logits / params.temperature, -1)
    if params.top_k:
        target[torch.argsort(target, descending=True)[params.top_k :]] = 0
    if params.top_p < 1.0:
        order = torch.argsort(target, descending=True)
        before = target[order].cumsum(-1) - target[order]
        target[order[before >= params.top_p]] = 0
    target = target / target.sum()
    draws = 4000
    rows = logits.expand(draws, -1)
    picks = sample_rows(rows, params=[params] * draws, positions=list(range(draws)))
    counts = torch.bincount(torch.tensor([s.token_id for s in picks]), minlength=logits.shape[0]).double()
    expected = target.double() * draws
    spread = (expected * (1 - target.double())).sqrt()
    assert torch.all((counts - expected).abs() <= 5 * spread + 1e-9), (counts.tolist(), expected.tolist())
