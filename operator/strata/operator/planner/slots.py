"""The GPUs a plan may use, in the order the search tries them: most usable memory first.

Identical GPUs are grouped per node (an 8-GPU node is one inventory entry), sorted once, and expanded only as far
as the search can use: a plan never needs more GPUs than the model has layers. Within equal memory, node name
order keeps a node's GPUs next to each other, so consecutive stages share a host where they can.
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.operator.planner.inventory import Inventory
from strata.operator.planner.memory import usable_bytes
from strata.plan import Backend


@dataclass(frozen=True)
class Slot:
    node: str
    resource: str
    backend: Backend
    memory_bytes: int
    usable_bytes: int


def ordered_slots(inventory: Inventory, *, headroom_fraction: float, limit: int) -> list[Slot]:
    """Up to `limit` GPUs, most usable memory first, then by node name; deterministic for a given inventory."""
    groups = []
    for entry in inventory.gpus:
        usable = usable_bytes(memory_bytes=entry.memory_bytes, backend=entry.backend, fraction=headroom_fraction)
        groups.append((-usable, entry.node, entry.resource, entry))
    groups.sort(key=lambda group: group[:3])
    slots: list[Slot] = []
    for negative_usable, _node, _resource, entry in groups:
        if len(slots) >= limit:
            break
        take = min(entry.free, limit - len(slots))
        slot = Slot(entry.node, entry.resource, entry.backend, entry.memory_bytes, -negative_usable)
        slots.extend([slot] * take)
    return slots


def pool_usable_bytes(inventory: Inventory, *, headroom_fraction: float) -> int:
    """Usable memory summed over every free GPU in the inventory."""
    return sum(
        entry.free * usable_bytes(memory_bytes=entry.memory_bytes, backend=entry.backend, fraction=headroom_fraction)
        for entry in inventory.gpus
    )
