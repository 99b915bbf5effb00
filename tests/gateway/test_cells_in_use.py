"""The driver's count of the stages' cells: blocks that generations share through a prefix snapshot count once."""

from __future__ import annotations

import pytest
from strata.gateway.generation import Generation, Sampling, cells_in_use

BLOCK = 64


def generation(*, fed: int, cached: int = 0, shares: bytes | None = None, keeps: bytes | None = None) -> Generation:
    g = Generation(
        slot=0,
        prompt=tuple(range(fed)),
        max_tokens=8,
        sampling=Sampling(temperature=0.0),
        stop_ids=frozenset(),
        on_freed=lambda: None,
    )
    g.fed, g.cached, g.shares, g.keeps = fed, cached, shares, keeps
    return g


@pytest.mark.parametrize(
    ("generations", "cells"),
    [
        pytest.param([generation(fed=150), generation(fed=100)], 250, id="generations that share nothing add up"),
        pytest.param(
            [generation(fed=150, keeps=b"p"), generation(fed=150, cached=144, shares=b"p")],
            150 + (150 - 128),
            id="a choice sharing the producer's prompt holds only its copied last block and past it",
        ),
        pytest.param(
            [generation(fed=150, cached=144, shares=b"p"), generation(fed=150, cached=144, shares=b"p")],
            128 + 2 * (150 - 128),
            id="sharers of a snapshot whose producer ended count its whole blocks once",
        ),
        pytest.param(
            [generation(fed=150, cached=144, shares=b"p"), generation(fed=150, cached=144, shares=b"q")],
            2 * 128 + 2 * (150 - 128),
            id="sharers of two snapshots count each",
        ),
        pytest.param(
            [generation(fed=40, cached=32, shares=b"p")],
            40,
            id="a restore shorter than a block shares no whole block",
        ),
    ],
)
def test_shared_blocks_count_once(generations: list[Generation], cells: int) -> None:
    assert cells_in_use(generations, block=BLOCK) == cells
