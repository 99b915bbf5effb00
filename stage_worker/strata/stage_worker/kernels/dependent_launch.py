"""Programmatic dependent launch (Hopper and later): a decode step's kernels may start before the kernel ahead of
them has finished, and wait for its results before they read them.

A one-stream decode step is some 280 kernels in a CUDA graph (Llama-3-8B, Q8_0), each with a ramp and a tail, and
the next kernel's programs are launched only once the whole kernel is done. Launched with CUDA's programmatic stream
serialisation, a kernel's programs may start as soon as every program of the kernel ahead has called
`griddepcontrol.launch_dependents`; each then waits (`griddepcontrol.wait`) until that kernel has completed and its
writes are visible.

Measured before (docs/benchmarks.md, "Launching the next kernel early", H100, 2026-12-07, a scratch chain of the
step's matrix products alone): Q8_0 products 1.6% faster, Q4_K ones 5% slower, and prefetching weights into L2
before the wait 11-13% slower on both, so nothing runs before the wait here. What that chain could not say is what
the whole step gains, attention and the small kernels included, and no lease has timed that yet: kernels launch
plainly unless `STRATA_DEPENDENT_LAUNCH=1`, and bench/decode_profile.py --launches times the step both ways in one
run.

The rule every kernel launched this way keeps (`wait_for_inputs`, first thing): nothing before the wait reads what
another kernel writes, or writes anything (a buffer the kernel ahead still reads may be this one's output); every
program waits, so the kernel cannot complete before the one ahead, and the next kernel's wait covers both. Kernels
launched plainly (torch's, the compiled blocks') wait for everything ahead as always.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

ENVIRONMENT = "STRATA_DEPENDENT_LAUNCH"


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch as dependents: where STRATA_DEPENDENT_LAUNCH is 1, on a CUDA device of
    compute capability 9.0 or later."""
    setting = os.environ.get(ENVIRONMENT, "0")
    if setting not in ("0", "1"):
        raise ValueError(f"{ENVIRONMENT} must be 0 or 1, not {setting!r}")
    if setting == "0" or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def options(device: torch.device) -> dict[str, object]:
    """The launch's keyword arguments (Triton's `launch_pdl`) and the kernel's PDL constexpr, together: a kernel
    launched as a dependent must wait, and a kernel that waits is compiled apart from one that does not."""
    if enabled(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Wait for the kernel ahead to complete (its writes visible), then let the next kernel's programs start. A no-op
    in a plain launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
