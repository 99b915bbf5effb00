"""Kubernetes resource quantities ("80Gi", "500M", "1.5G") as bytes: the spec's memory fields and the command
lines that take the same values read them with one rule."""

from __future__ import annotations

import re

_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$")
_SCALE = {
    None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}  # fmt: skip


def quantity_to_bytes(value: str) -> int:
    """The bytes a quantity names; ValueError when it is not one."""
    match = _QUANTITY.match(value)
    if match is None:
        raise ValueError(f"{value!r} is not a Kubernetes quantity such as 80Gi")
    return int(float(match.group(1)) * _SCALE[match.group(2)])
