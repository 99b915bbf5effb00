"""The switch for programmatic dependent launch (strata.stage_worker.kernels.dependent_launch): which launches wait,
and a setting it does not know refused by name. On a GPU, tests/gpu/test_dependent_launch_gpu.py checks that a chain
of dependent products reads each result only once it is written."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from strata.stage_worker.kernels import dependent_launch


@dataclass(frozen=True)
class Case:
    name: str
    setting: str | None
    device: str
    options: dict[str, object] | None  # None: refused
    refusal: str = ""


CASES = [
    Case("plain unless switched on", None, "cpu", {"PDL": False}),
    Case("switched off", "0", "cpu", {"PDL": False}),
    Case("switched on, still plain on the CPU", "1", "cpu", {"PDL": False}),
    Case("a word it does not know", "yes", "cpu", None, "STRATA_DEPENDENT_LAUNCH must be 0 or 1, not 'yes'"),
    Case("an empty setting", "", "cpu", None, "STRATA_DEPENDENT_LAUNCH must be 0 or 1, not ''"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_options(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    if case.setting is None:
        monkeypatch.delenv(dependent_launch.ENVIRONMENT, raising=False)
    else:
        monkeypatch.setenv(dependent_launch.ENVIRONMENT, case.setting)
    if case.options is None:
        with pytest.raises(ValueError, match=case.refusal):
            dependent_launch.options(torch.device(case.device))
        return
    assert dependent_launch.options(torch.device(case.device)) == case.options
