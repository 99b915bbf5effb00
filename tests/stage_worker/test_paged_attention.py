"""The pool attention kernel against its plain reference, on the table of cases in strata_testbed.attention_cases.

Without a GPU the kernel runs under Triton's interpreter (the same kernel source, executed with numpy), in f32 and f16
(the interpreter has no bfloat16); bench/attention.py runs the same table on a GPU in bf16, f16 and f32.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from strata_testbed.attention_cases import CASES, AttentionCase, run_case, tolerance

TRITON_MODULE = "strata.stage_worker.kernels.paged_attention_triton"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("case", [c for c in CASES if not c.gpu_only], ids=lambda c: c.name)
def test_kernel_matches_reference(case: AttentionCase, dtype: torch.dtype, device: torch.device) -> None:
    error = run_case(case, device=device, dtype=dtype, seed=hash(case.name) % 1000)
    assert error <= tolerance(dtype), f"{case.name}: relative error {error:.2e} over {tolerance(dtype):.0e}"


def test_a_wrong_kernel_fails_the_check(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: a kernel that drops the last position of every sequence is caught."""
    module = importlib.import_module(TRITON_MODULE)
    real = module.paged_attention

    def short(q: torch.Tensor, **kwargs: object) -> torch.Tensor:
        kv_lens = kwargs.pop("kv_lens")
        assert isinstance(kv_lens, torch.Tensor)
        out: torch.Tensor = real(q, kv_lens=(kv_lens - 1).clamp_min(1), **kwargs)
        return out

    monkeypatch.setattr(module, "paged_attention", short)
    case = AttentionCase("short by one", kv_lens=(5, 40))
    assert run_case(case, device=device, dtype=torch.float32) > 1e-2
