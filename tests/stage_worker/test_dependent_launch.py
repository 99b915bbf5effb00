"""The switch for programmatic dependent launch (strata.stage_worker.kernels.dependent_launch): which launches wait
(a captured decode step's, on Hopper, unless switched off), and a setting it does not know refused by name. On a GPU,
tests/gpu/test_dependent_launch_gpu.py checks that a chain of dependent products reads each result only once it is
written."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from strata.stage_worker.kernels import dependent_launch

DEPENDENT: dict[str, object] = {"PDL": True, "launch_pdl": True}
PLAIN: dict[str, object] = {"PDL": False}


@dataclass(frozen=True)
class Case:
    name: str
    setting: str | None  # None: unset
    device: str
    captured: bool  # launched inside dependent_launch.captured_step
    options: dict[str, object] | None  # None: refused
    capability: tuple[int, int] = (9, 0)
    refusal: str = ""


CASES = [
    Case("a captured step on Hopper, by default", None, "cuda", True, DEPENDENT),
    Case("a captured step, switched on", "1", "cuda", True, DEPENDENT),
    Case("a captured step, switched off", "0", "cuda", True, PLAIN),
    Case("an eager launch (prefill)", None, "cuda", False, PLAIN),
    Case("a captured step before Hopper", None, "cuda", True, PLAIN, capability=(8, 0)),
    Case("a captured step on Blackwell", None, "cuda", True, DEPENDENT, capability=(10, 0)),
    Case("the CPU", "1", "cpu", True, PLAIN),
    Case("a word it does not know", "yes", "cpu", False, None, refusal="must be 0 or 1, not 'yes'"),
    Case("an empty setting", "", "cuda", True, None, refusal="STRATA_DEPENDENT_LAUNCH must be 0 or 1, not ''"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_options(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    if case.setting is None:
        monkeypatch.delenv(dependent_launch.ENVIRONMENT, raising=False)
    else:
        monkeypatch.setenv(dependent_launch.ENVIRONMENT, case.setting)
    # the capability of a device this machine may not have: only the switch reads it
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: case.capability)
    device = torch.device(case.device)

    def options() -> dict[str, object]:
        if not case.captured:
            return dependent_launch.options(device)
        with dependent_launch.captured_step():
            return dependent_launch.options(device)

    if case.options is None:
        with pytest.raises(ValueError, match=case.refusal):
            options()
        return
    assert options() == case.options


def test_the_captured_step_ends_with_its_block(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(dependent_launch.ENVIRONMENT, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    device = torch.device("cuda")
    with dependent_launch.captured_step():
        with dependent_launch.captured_step():
            pass
        assert dependent_launch.options(device) == DEPENDENT, "an inner step ended the outer one"
    assert dependent_launch.options(device) == PLAIN
