"""Sampled speculative output follows the target's distribution at temperature 1, measured on a real engine.

The last stage verifies a draft by drawing its own token at each drafted position and keeping the draft while the
draws equal it (strata.stage_worker.engine.accept). Both drafters propose a single token per position (n-gram lookup,
a draft model's greedy run), so the draft distribution q is one token d with probability 1, and the standard
rejection-sampling rule (accept d with probability min(1, p(d)/q(d)) = p(d); on rejection draw from p with d removed,
renormalised) gives the target's p exactly. This measures that the engine does: over many seeds, the first token of a
verified run is distributed as the target's p at that position, a draft is accepted as often as p gives it, and the
token after an accepted draft is distributed as the target's p after it. A chi-square test over the likely tokens
and the rest, at a significance of 0.001, so it fails on a wrong rule and passes on the right one but for a 1 in
1000 chance per case.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from strata.gguf.model import CacheType
from strata.stage_worker.engine import Chunk, Engine
from strata.stage_worker.kv_pool import KVPool
from strata.stage_worker.sampling import Sampling
from strata_testbed.stages import load_spans

CPU = torch.device("cpu")
PROMPT = (1, 17, 200, 3, 45, 99, 12, 7, 250, 31, 64, 128)
LANES = 16  # trials a step: one per slot, each its own seed
TRIALS = 640
# The generated model's logits are nearly flat over 1000 tokens; a bias on a few tokens (a part of the target's
# distribution, as OpenAI's logit_bias is) gives it likely tokens, so a few hundred draws tell distributions apart.
LIKELY = (5, 40, 300, 777)
BIAS = tuple((token, 8.0) for token in LIKELY)
CHI_SQUARE_0_001 = {4: 18.47}  # the chi-square quantile at 0.999 by degrees of freedom (buckets - 1)


def engine(path: Path) -> Engine:
    (model,) = load_spans(path, [(0, 3)])
    c = model.config
    pool = KVPool(
        n_layers=3, context=64, parallel=LANES, key_width=c.kv_dim, value_width=c.kv_dim,
        type_k=CacheType.F32, type_v=CacheType.F32, dtype=torch.float32, device=CPU,
    )  # fmt: skip
    return Engine(model=model, pool=pool, device=CPU, dtype=torch.float32)


def target(e: Engine, tokens: tuple[int, ...]) -> torch.Tensor:
    """The target's distribution after `tokens` at temperature 1 with the bias: [vocab]."""
    logits = e.step([Chunk(0, 0, len(tokens), tokens, return_logits=True)], None).logits[0][-1].clone()
    for token, bias in BIAS:
        logits[token] += bias
    return torch.softmax(logits, dim=-1)


def chi_square(counts: Counter[int], p: torch.Tensor) -> float:
    """Over the buckets LIKELY..., and every other token together."""
    total = sum(counts.values())
    observed = [counts[t] for t in LIKELY] + [total - sum(counts[t] for t in LIKELY)]
    expected = [float(p[t]) * total for t in LIKELY] + [(1.0 - float(p[list(LIKELY)].sum())) * total]
    return sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))


DRAFTS = {"a likely draft": LIKELY[0], "an unlikely draft": 600}


@pytest.mark.parametrize("draft", DRAFTS.values(), ids=DRAFTS.keys())
def test_verified_runs_follow_the_targets_distribution_at_temperature_1(
    tiny_models: dict[str, Path], draft: int
) -> None:
    e = engine(tiny_models["llama"])
    first_p, after_p = target(e, PROMPT), target(e, (*PROMPT, draft))
    e.step([Chunk(slot, 0, len(PROMPT) - 1, PROMPT[:-1]) for slot in range(LANES)], None)
    start = len(PROMPT) - 1
    firsts: Counter[int] = Counter()
    afters: Counter[int] = Counter()
    for at in range(0, TRIALS, LANES):
        seeds = [Sampling(temperature=1.0, seed=at + slot + 1, logit_bias=BIAS) for slot in range(LANES)]
        chunks = [
            Chunk(slot, start, 2, (PROMPT[-1], draft), sample=True, sampling=sampling, drafted=1)
            for slot, sampling in enumerate(seeds)
        ]
        for run in e.step(chunks, None).runs.values():
            firsts[run[0].token_id] += 1
            if len(run) == 2:
                afters[run[1].token_id] += 1
    assert chi_square(firsts, first_p) < CHI_SQUARE_0_001[len(LIKELY)]
    accepted = firsts[draft] / TRIALS
    spread = 4 * (float(first_p[draft]) * (1 - float(first_p[draft])) / TRIALS) ** 0.5 + 1 / TRIALS
    assert abs(accepted - float(first_p[draft])) <= spread, "a draft is accepted as often as the target picks it"
    if draft in LIKELY:  # enough accepted runs to test the token after them
        assert sum(afters.values()) == firsts[draft] > TRIALS // 10
        assert chi_square(afters, after_p) < CHI_SQUARE_0_001[len(LIKELY)]
