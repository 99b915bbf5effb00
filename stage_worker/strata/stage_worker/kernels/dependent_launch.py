"""Programmatic dependent launch (Hopper and later): a captured decode step's kernels may start before the kernel
ahead of them has finished, and wait for its results before they read them.

A one-stream decode step is some 250 kernels in a CUDA graph (Llama-3-8B, Q8_0), each with a ramp and a tail, and
the next kernel's programs are launched only once the whole kernel is done. Launched with CUDA's programmatic stream
serialisation, a kernel's programs may start as soon as every program of the kernel ahead has called
`griddepcontrol.launch_dependents`; each then waits (`griddepcontrol.wait`) until that kernel has completed and its
writes are visible.

Measured (docs/benchmarks.md): on the step's matrix products alone, Q8_0 1.6% faster, Q4_K 5% slower, and
prefetching weights into L2 before the wait 11-13% slower, so nothing runs before the wait here; on the whole
one-stream step, attention and the small kernels included (H100, 2026-12-07, bench/decode_profile.py --launches,
Q8_0), 3.543 ms against 3.620 plainly (1.022x). So the kernels of a step the decoder captures in a CUDA graph
(`captured_step`) launch as dependents, unless STRATA_DEPENDENT_LAUNCH=0. Eager steps (prefill chunks) launch
plainly: there the host's launches set the pace, and the lease that launched every kernel as a dependent served a
4,096-token prompt in steps of 256 tokens in 982 ms against 682 in the lease before, the cause not isolated.

The rule every kernel launched this way keeps (`wait_for_inputs`, first thing): nothing before the wait reads what
another kernel writes, or writes anything (a buffer the kernel ahead still reads may be this one's output); every
program waits, so the kernel cannot complete before the one ahead, and the next kernel's wait covers both. Kernels
launched plainly (torch's, the compiled blocks') wait for everything ahead as always.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import triton
import triton.language as tl

ENVIRONMENT = "STRATA_DEPENDENT_LAUNCH"
_launching = threading.local()  # .captured: inside `captured_step` on this thread


def switched_on() -> bool:
    """STRATA_DEPENDENT_LAUNCH: 1 (the default) or 0; any other value is refused by name."""
    setting = os.environ.get(ENVIRONMENT, "1")
    if setting not in ("0", "1"):
        raise ValueError(f"{ENVIRONMENT} must be 0 or 1, not {setting!r}")
    return setting == "1"


@contextmanager
def captured_step() -> Iterator[None]:
    """The launches of a decode step that is captured in a CUDA graph (and its warm-up run, which compiles the same
    kernels): where `enabled` allows, they launch as dependents."""
    outer = getattr(_launching, "captured", False)
    _launching.captured = True
    try:
        yield
    finally:
        _launching.captured = outer


def enabled(device: torch.device) -> bool:
    """Whether a kernel launched now on `device` launches as a dependent: inside `captured_step`, switched on, on a
    CUDA device of compute capability 9.0 or later."""
    if not switched_on() or device.type != "cuda" or not getattr(_launching, "captured", False):
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
