"""Programmatic dependent launch (Hopper and later): a decode step's kernels start before the kernel ahead of them
has finished, and wait for its results only where they read them.

A one-stream decode step is some 280 kernels in a CUDA graph (Llama-3-8B, Q8_0): its matrix products read the
weights at up to 2.9 TB/s in their middle, but each starts with its multiprocessors waiting on their first loads
and ends on a tail of its last programs, and the next kernel's programs are launched only once the whole kernel is
done. Launched with CUDA's programmatic stream serialisation, a kernel's programs may start as soon as every
program of the kernel ahead has called `griddepcontrol.launch_dependents`; each then waits (`griddepcontrol.wait`)
until that kernel has completed and its writes are visible. What a program does before the wait overlaps the kernel
ahead: the products prefetch their first weights into L2 there, since no kernel of a step writes weights.

The rule every kernel launched this way keeps (`wait_for_inputs`): nothing before the wait reads what another kernel
writes, or writes anything (a buffer the kernel ahead still reads may be this one's output); every program waits,
so the kernel cannot complete before the one ahead, and the next kernel's wait covers both. Kernels launched
plainly (torch's, the compiled blocks') wait for everything ahead as always.

`STRATA_DEPENDENT_LAUNCH=0` launches them plainly, for a side-by-side measurement (bench/decode_profile.py).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

ENVIRONMENT = "STRATA_DEPENDENT_LAUNCH"


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch as dependents: a CUDA device of compute capability 9.0 or later, unless
    STRATA_DEPENDENT_LAUNCH is 0."""
    setting = os.environ.get(ENVIRONMENT, "1")
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


@triton.jit
def prefetch_l2(pointers, PDL: tl.constexpr):
    """Ask L2 for the lines at `pointers` (one address a 128-byte line is enough), without waiting for them: before
    `wait_for_inputs`, for bytes no kernel of the step writes."""
    if PDL:
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [pointers], dtype=tl.int32, is_pure=False, pack=1
        )
