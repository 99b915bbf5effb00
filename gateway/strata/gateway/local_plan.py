"""Planning `strata serve` for this machine: stages on its devices, each device's stages fitted to its own memory.

The cluster planner (strata.operator.planner) searches pools of GPUs; the gateway may not import it (an import-linter
contract keeps operator code out of the data plane), and one machine has nothing to search: its stages take even
layer spans on the same device. It must still answer the planner's question, does the model fit and with how much
context, by the planner's rules: headroom stays free, the KV cache gets 85% of what the weights leave, the context
is snapped down to a multiple of 256 (never below 512), and a context the user asks for is honoured or refused with
what would fit, never shrunk. Compute buffers are small beside a machine's memory and come out of the headroom.
Weights count as the bytes a GPU stage holds once loaded (ModelInfo's resident figures), not the file's size. A CPU
stage computes in float32 and holds up to twice that; ModelInfo does not carry the element counts to say exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from strata.fit import DEFAULT_HEADROOM_FRACTION, KV_BUDGET_PERCENT, candidate_contexts
from strata.gateway.local import even_spans
from strata.gguf.model import CacheType, ModelInfo
from strata.plan import GB

# A workstation's memory serves everything else it runs too: unless asked, the context grows no further than this.
DEFAULT_CONTEXT_CAP = 4096
MEMINFO = Path("/proc/meminfo")


class LocalFitError(ValueError):
    """The model, or the context asked for, does not fit this machine's device; the message says by how much."""


@dataclass(frozen=True, kw_only=True)
class DeviceUse:
    """What the stages on one device take there."""

    device: str
    stages: tuple[int, ...]
    weight_bytes: int  # their weights as loaded: the first stage adds token_embd, the last the output head
    kv_bytes: int  # their KV pools at the plan's context (the lanes share each pool)
    usable_bytes: int | None  # None: the device's memory is unknown and nothing was checked


@dataclass(frozen=True, kw_only=True)
class LocalPlan:
    spans: tuple[tuple[int, int], ...]
    devices: tuple[str, ...]  # stage i runs on devices[i]
    context: int
    uses: tuple[DeviceUse, ...]  # one per distinct device, in the order stages first name them

    @property
    def weight_bytes(self) -> int:
        return sum(use.weight_bytes for use in self.uses)

    @property
    def kv_bytes(self) -> int:
        return sum(use.kv_bytes for use in self.uses)


def stage_devices(*, device: str, devices: str, stages: int, gpu_count: int) -> tuple[str, ...]:
    """The device of each stage. `devices` (a comma-separated list, one per stage) chooses outright; otherwise every
    stage runs on `device`, and `cuda` alone places stage i on GPU i mod the GPU count."""
    if devices:
        chosen = tuple(d.strip() for d in devices.split(","))
        if len(chosen) != stages:
            raise ValueError(f"--devices names {len(chosen)} devices for {stages} stages; give one per stage")
    elif device == "cuda":
        if gpu_count < 1:
            raise ValueError("--device cuda: no CUDA GPU is visible")
        chosen = tuple(f"cuda:{i % gpu_count}" for i in range(stages))
    else:
        chosen = (device,) * stages
    for name in chosen:
        kind, _, index = name.partition(":")
        if kind == "cpu" and not index:
            continue
        if kind != "cuda" or not index.isdigit():
            raise ValueError(f"device {name!r} is not cpu, cuda or cuda:N")
        if int(index) >= gpu_count:
            raise ValueError(f"device {name!r}: this machine has {gpu_count} CUDA GPU(s)")
    return chosen


def stage_weight_bytes(model: ModelInfo, span: tuple[int, int], *, stages: int) -> int:
    """One stage's resident weights; a tied output head shares token_embd only when one stage holds both."""
    start, end = span
    weights = sum(model.layer_resident_bytes[start:end])
    if start == 0:
        weights += model.resident_embedding_bytes
    if end == model.block_count:
        weights += model.resident_head_bytes
        if model.output_tied and stages == 1:
            weights -= model.resident_embedding_bytes
    return weights


def plan_local(
    *,
    model: ModelInfo,
    devices: tuple[str, ...],
    parallel: int,
    cache_type: CacheType,
    available: Mapping[str, int | None],
    context: int = 0,
    resident: bool = False,
) -> LocalPlan:
    """Spans, context and the bytes they take on each device, stage i on devices[i], each device with
    available[device] bytes free (None: unknown); `context` 0: the largest that fits everywhere, up to
    DEFAULT_CONTEXT_CAP; `resident`: the stages keep a resident window's key bounds. Raises ValueError for more stages
    than layers, LocalFitError when it does not fit."""
    spans = even_spans(model.block_count, len(devices))
    native = model.context_length
    if context > native:
        raise LocalFitError(f"context {context} exceeds the model's native context {native}")
    on: dict[str, list[int]] = {}
    for index, device in enumerate(devices):
        on.setdefault(device, []).append(index)
    weights = {d: sum(stage_weight_bytes(model, spans[i], stages=len(spans)) for i in idx) for d, idx in on.items()}

    def kv(device: str, cells: int) -> int:
        layers = [layer for i in on[device] for layer in range(*spans[i])]
        return model.kv_bytes(
            n_ctx=cells, type_k=cache_type, type_v=cache_type, layers=layers, n_seq=parallel, resident=resident
        )

    usable = {d: int(free * (1 - DEFAULT_HEADROOM_FRACTION)) for d in on if (free := available.get(d)) is not None}
    budget = {d: max(0, u - weights[d]) * KV_BUDGET_PERCENT // 100 for d, u in usable.items()}

    def plan(cells: int) -> LocalPlan:
        uses = tuple(
            DeviceUse(
                device=d, stages=tuple(i), weight_bytes=weights[d], kv_bytes=kv(d, cells), usable_bytes=usable.get(d)
            )
            for d, i in on.items()
        )
        return LocalPlan(spans=tuple(spans), devices=devices, context=cells, uses=uses)

    if not budget:
        return plan(context or min(native, DEFAULT_CONTEXT_CAP))
    # Asked for a context, the message names the largest that fits at all; otherwise the default stops at the cap.
    top = native if context else min(native, DEFAULT_CONTEXT_CAP)
    candidates = candidate_contexts(native=top) or [top]
    fitting = [cells for cells in candidates if all(kv(d, cells) <= b for d, b in budget.items())]
    if not fitting:
        smallest = candidates[0]
        required = {d: weights[d] + kv(d, smallest) * 100 // KV_BUDGET_PERCENT for d in usable}
        device = max(usable, key=lambda d: required[d] - usable[d])
        raise LocalFitError(
            f"requires {required[device] / GB:.1f} GB on {device} at context {smallest}, it has "
            f"{usable[device] / GB:.1f} GB usable, short by {(required[device] - usable[device]) / GB:.1f} GB"
        )
    if context and any(kv(d, context) > b for d, b in budget.items()):
        device = next(d for d, b in budget.items() if kv(d, context) > b)
        raise LocalFitError(
            f"context {context} needs {kv(device, context) / GB:.2f} GB of KV on {device} beside "
            f"{weights[device] / GB:.1f} GB of weights, and {budget[device] / GB:.2f} GB is left for it; the largest "
            f"context that fits is {fitting[-1]}"
        )
    return plan(context or fitting[-1])


def available_memory_bytes(device: str) -> int | None:
    """What the stages may take on `device` now: the kernel's MemAvailable for the CPU, free memory for a CUDA
    device; None for a device whose memory this cannot read."""
    if device == "cpu":
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
        return None
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            free, _total = torch.cuda.mem_get_info(torch.device(device))
            return int(free)
    return None


def process_groups(devices: tuple[str, ...], *, process_per_stage: bool = False) -> tuple[tuple[int, ...], ...]:
    """The stage processes `strata serve` starts, each as the indices of its stages: consecutive stages on the same
    device share one process (they take turns on the device either way, and in one process the activations pass in
    memory and the device keeps one context); `process_per_stage` gives every stage a process of its own."""
    groups: list[list[int]] = []
    for index, device in enumerate(devices):
        if groups and not process_per_stage and devices[groups[-1][-1]] == device:
            groups[-1].append(index)
        else:
            groups.append([index])
    return tuple(tuple(group) for group in groups)
