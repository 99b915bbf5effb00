"""The decode step's greedy pick (kernels/greedy_pick_triton.py) against torch's argmax and logsumexp, on a table of
named cases; under Triton's interpreter on the CPU, compiled on a GPU."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from strata.stage_worker.kernels.greedy_pick import kernel, reference


@dataclass(frozen=True)
class Case:
    name: str
    rows: int
    vocab: int
    values: str = "normal"  # "normal"; "ties" (the maximum repeated: the first index wins); "masked" (-inf logits);
    # "large" (|logits| to 1e30: exp's range is passed only relative to the maximum); "one chunk" (vocab < a chunk)


CASES = [
    Case("one row, a 128K vocabulary", 1, 128_256),
    Case("16 rows, a vocabulary not a multiple of the chunk", 16, 5_003),
    Case("ties across chunks", 3, 9_000, "ties"),
    Case("most logits masked", 2, 7_000, "masked"),
    Case("large logits", 2, 6_000, "large"),
    Case("a vocabulary inside one chunk", 4, 300),
]


def _logits(case: Case, generator: torch.Generator) -> torch.Tensor:
    logits = torch.randn(case.rows, case.vocab, generator=generator) * 3
    if case.values == "ties":
        logits[:, [17, 2_500, 8_999]] = 50.0  # in three different chunks
        logits[1, 17] = 0.0  # row 1: the first maximum is in the second chunk
    elif case.values == "masked":
        keep = torch.rand(case.rows, case.vocab, generator=generator) < 0.01
        logits = logits.masked_fill(~keep, float("-inf"))
    elif case.values == "large":
        logits = logits * 1e29
    return logits


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_greedy_pick_is_argmax_and_its_logprob(case: Case, device: torch.device) -> None:
    logits = _logits(case, torch.Generator().manual_seed(case.vocab))
    ours = kernel(logits.to(device)).cpu()
    expected = reference(logits)
    assert ours.shape == (2, case.rows)
    assert torch.equal(ours[0], expected[0]), f"{case.name}: tokens {ours[0]} against {expected[0]}"
    assert torch.allclose(ours[1], expected[1], rtol=1e-5, atol=1e-5), f"{case.name}: {ours[1]} against {expected[1]}"


def test_the_greedy_op_passes_opcheck(device: torch.device) -> None:
    from strata.stage_worker.kernels import greedy_pick

    torch.library.opcheck(greedy_pick._greedy_pick_op, (torch.randn(3, 4_100, device=device),))
