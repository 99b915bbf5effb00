"""The last stage's picks of a step: a token after each sampled chunk's last position, or after each of a drafted
chunk's last drafted + 1 positions, kept up to the first that differs from the draft.

Why drafts are verified this way: pick j follows the position that holds draft[j - 1] (pick 0 the last undrafted
one), so a pick counts only while every draft token before it was the model's own pick, and the tokens are exactly
those that one position a step would have produced. That holds for sampled picks too: a pick is drawn from its
position's distribution with the uniform number seeded by (seed, position), as a step of one position draws it, and
the draft counts only where that draw is the draft (which happens with the draft's probability: this is speculative
sampling with a proposal certain of its token, coupled to the plain draw). Under a grammar each pick samples inside
its own mask: the first inside the chunk's, pick k inside the one that the draft's first k tokens lead to (the
coordinator computes them, as it computes every mask).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from strata.stage_worker.sampling import Sampled, Sampling, sample_rows
from torch import Tensor

if TYPE_CHECKING:
    from strata.stage_worker.engine import Chunk

Picked = tuple[dict[int, Sampled], dict[int, tuple[Sampled, ...]]]  # slot -> its pick; slot -> its accepted run


def accept(picks: list[Sampled], draft: tuple[int, ...]) -> tuple[Sampled, ...]:
    """The picks after a drafted chunk's last len(draft) + 1 positions, up to and including the first that differs
    from the draft."""
    taken = 0
    while taken < len(draft) and picks[taken].token_id == draft[taken]:
        taken += 1
    return tuple(picks[: taken + 1])


def pick_sampling(chunk: Chunk, k: int) -> Sampling:
    """How a chunk's k-th pick samples: under a grammar, pick k > 0 follows drafted position k and takes its mask."""
    if k == 0 or not chunk.draft_allowed:
        return chunk.sampling
    return replace(chunk.sampling, allowed=chunk.draft_allowed[k - 1])


def pick(
    rows: Sequence[tuple[Chunk, list[int]]],
    logits: Tensor,
    *,
    greedy: tuple[list[float], list[float]] | None = None,
) -> Picked:
    """Each sampling chunk's picks from its rows of `logits` (the rows after its last drafted + 1 positions, in
    order). `greedy`: the step's argmax tokens and their log-probabilities by row, already on the host; the chunks
    whose sampling is greedy as is take their picks from there."""
    taken = [(chunk, mine) for chunk, mine in rows if not (greedy is not None and chunk.sampling.greedy_as_is)]
    positions = [
        chunk.start_position + chunk.length - len(mine) + k + 1 for chunk, mine in taken for k in range(len(mine))
    ]
    params = [pick_sampling(chunk, k) for chunk, mine in taken for k in range(len(mine))]
    chosen = [row for _, mine in taken for row in mine]
    drawn = iter(sample_rows(logits[chosen], params=params, positions=positions) if taken else ())
    single: dict[int, Sampled] = {}
    runs: dict[int, tuple[Sampled, ...]] = {}
    for chunk, mine in rows:
        if greedy is not None and chunk.sampling.greedy_as_is:
            tokens, logprobs = greedy
            picks = [Sampled(token_id=int(tokens[r]), logprob=logprobs[r], top_logprobs=()) for r in mine]
        else:
            picks = [next(drawn) for _ in mine]
        if chunk.drafted:
            runs[chunk.slot] = accept(picks, chunk.token_ids[chunk.length - chunk.drafted :])
        else:
            single[chunk.slot] = picks[0]
    return single, runs
