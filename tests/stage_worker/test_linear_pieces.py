"""A matrix's output by part, and its columns cut into q, k and v (weights.linear.split_columns): the same values as
cutting the joined output, and views of the parts wherever a run lies inside one (the copies a Q4_K_M layer spared)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from strata.stage_worker.weights.linear import DenseRows, PackedLinear, joined, split_columns


@dataclass(frozen=True)
class Cut:
    name: str
    widths: tuple[int, ...]  # the parts' columns
    sizes: tuple[int, ...]  # the runs cut from them
    views: tuple[bool, ...]  # which runs are views of a part


CUTS = [
    Cut("one part, q k v inside it", (12,), (8, 2, 2), (True, True, True)),
    Cut("q and k in one part, v the other (Q4_K beside Q6_K)", (10, 2), (8, 2, 2), (True, True, True)),
    Cut("a part each", (8, 2, 2), (8, 2, 2), (True, True, True)),
    Cut("k across two parts", (9, 3), (8, 2, 2), (True, False, True)),
    Cut("q across three parts", (3, 3, 6), (8, 2, 2), (False, True, True)),
]


def _shares_storage(run: torch.Tensor, pieces: list[torch.Tensor]) -> bool:
    return any(run.untyped_storage().data_ptr() == piece.untyped_storage().data_ptr() for piece in pieces)


@pytest.mark.parametrize("cut", CUTS, ids=lambda c: c.name)
def test_runs_are_the_joined_columns_and_views_inside_a_part(cut: Cut) -> None:
    pieces = [torch.randn(3, width) for width in cut.widths]
    runs = split_columns(pieces, cut.sizes)
    expected = torch.split(torch.cat(pieces, dim=-1), list(cut.sizes), dim=-1)
    assert [run.shape for run in runs] == [part.shape for part in expected]
    assert all(torch.equal(run, part) for run, part in zip(runs, expected, strict=True))
    assert tuple(_shares_storage(run, pieces) for run in runs) == cut.views


@pytest.mark.parametrize(("widths", "sizes"), [((8, 4), (8, 2, 1)), ((8, 4), (12, 0)), ((4,), (2, 3))])
def test_a_cut_that_does_not_tile_the_columns_is_refused(widths: tuple[int, ...], sizes: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="cannot be cut into"):
        split_columns([torch.zeros(1, width) for width in widths], sizes)


def test_pieces_carry_the_bias_of_their_columns() -> None:
    parts = [DenseRows(torch.randn(5, 4)), DenseRows(torch.randn(3, 4))]
    bias = torch.randn(8)
    linear = PackedLinear(parts, bias=bias)
    x = torch.randn(2, 4)
    pieces = linear.pieces(x)
    assert [piece.shape[-1] for piece in pieces] == [5, 3]
    expected = x @ torch.cat([part.weight for part in parts]).T + bias
    assert torch.allclose(joined(pieces), expected, atol=1e-6)
    assert torch.allclose(linear(x), expected, atol=1e-6)
