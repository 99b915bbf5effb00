"""GPU vendors as a table: the extended resource each device plugin advertises, the labels that carry memory per
GPU, how to read them, and the backend a stage on that GPU runs.

Memory is not part of the Kubernetes resource model, so each vendor's node labeller publishes it in its own unit:
NVIDIA's GPU Feature Discovery in MiB, AMD's labeller as a size with a suffix (`192G`, in GiB as the labeller
divides by 1024), Intel's as plain bytes. Adding a vendor is one row here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from strata.plan import Backend

MIB = 1 << 20
_BINARY_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)([KMGT]?)(?:iB|i|B)?$", re.IGNORECASE)


class BadMemoryLabelError(ValueError):
    """A memory label whose value is not a size; the message names the label and the value."""


def parse_mebibytes(value: str) -> int:
    """`nvidia.com/gpu.memory`: an integer count of MiB (GPU Feature Discovery)."""
    if not value.strip().isdigit():
        raise BadMemoryLabelError(f"{value!r} is not a whole number of MiB")
    return int(value) * MIB


def parse_binary_size(value: str) -> int:
    """`amd.com/gpu.vram`: a number with an optional K/M/G/T suffix in powers of 1024 (`192G`, `64Gi`)."""
    match = _SIZE.match(value.strip())
    if match is None:
        raise BadMemoryLabelError(f"{value!r} is not a size such as 192G")
    number, suffix = match.groups()
    return int(float(number) * _BINARY_SUFFIXES[suffix.upper()])


def parse_bytes(value: str) -> int:
    """`gpu.intel.com/memory.max`: an integer count of bytes."""
    if not value.strip().isdigit():
        raise BadMemoryLabelError(f"{value!r} is not a whole number of bytes")
    return int(value)


@dataclass(frozen=True)
class Vendor:
    resource: str  # the extended resource in status.allocatable and in pod requests
    backend: Backend
    memory_labels: tuple[tuple[str, Callable[[str], int]], ...]  # first present label wins


VENDORS: tuple[Vendor, ...] = (
    Vendor("nvidia.com/gpu", Backend.CUDA, (("nvidia.com/gpu.memory", parse_mebibytes),)),
    Vendor(
        "amd.com/gpu",
        Backend.ROCM,
        (("amd.com/gpu.vram", parse_binary_size), ("beta.amd.com/gpu.vram", parse_binary_size)),
    ),
    Vendor("gpu.intel.com/i915", Backend.XPU, (("gpu.intel.com/memory.max", parse_bytes),)),
    Vendor("gpu.intel.com/xe", Backend.XPU, (("gpu.intel.com/memory.max", parse_bytes),)),
)
GPU_RESOURCES: tuple[str, ...] = tuple(vendor.resource for vendor in VENDORS)


def memory_from_labels(vendor: Vendor, labels: Mapping[str, str]) -> int | None:
    """Bytes per GPU from the vendor's labels, or None when no label is present; a malformed label raises."""
    for label, parse in vendor.memory_labels:
        if label in labels:
            try:
                return parse(str(labels[label]))
            except BadMemoryLabelError as error:
                raise BadMemoryLabelError(f"label {label}={labels[label]!r}: {error}") from None
    return None


def memory_label_names(vendor: Vendor) -> str:
    return " or ".join(label for label, _parse in vendor.memory_labels)
