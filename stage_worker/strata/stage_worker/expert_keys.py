"""A mixture of experts' fields of a stage's config, from the file's keys ({arch}.expert_count, expert_used_count,
expert_feed_forward_length) and the architecture table's routing (strata.gguf.architectures.Experts).

llama.cpp reads a few more routing keys for some architectures (a weight scale, a sigmoid gate, expert groups,
whether the top-k weights are renormalised); for the ones here it fixes them per architecture. A file that states
one of them with a value that would route otherwise than the table says is refused by name, not run another way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypedDict

from strata.gguf import GGUFHeader
from strata.gguf.architectures import Architecture
from strata.stage_worker.errors import ModelFileError


def _number(meta: Mapping[str, object], key: str, default: float | None) -> float | None:
    value = meta.get(key, default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise ModelFileError(f"{key} is not a number: {value!r}")
    return value


# llama.cpp's keys for routing its build_moe_ffn takes from the file for some architectures, and the value that
# leaves the routing as the architecture table describes it: another value would route in a way no stage runs.
ROUTING_KEYS = {"expert_weights_scale": (0.0, 1.0), "expert_gating_func": (1,), "expert_group_count": (0, 1)}


class ExpertFields(TypedDict, total=False):
    n_expert: int
    n_expert_used: int
    expert_ffn_dim: int
    renormalise_experts: bool


def expert_fields(header: GGUFHeader, description: Architecture, *, ffn_dim: int) -> ExpertFields:
    """The config's expert fields from the file: none for a dense file; a file whose experts the architecture has no
    place for, or that routes otherwise than the table says, is refused."""
    meta, arch = header.metadata, description.name
    count = int(_number(meta, f"{arch}.expert_count", 0) or 0)
    rule = description.experts
    if rule is None or not count:
        if count:
            raise ModelFileError(f"the file states {arch}.expert_count {count}, but {arch} models have no experts")
        if rule is not None and rule.required:
            raise ModelFileError(f"{arch} is a mixture of experts, but the file states no {arch}.expert_count")
        return ExpertFields()
    used = int(_number(meta, f"{arch}.expert_used_count", 0) or 0)
    if not 0 < used <= count:
        raise ModelFileError(f"{arch}.expert_used_count is {used}; it must be between 1 and expert_count {count}")
    for key, neutral in ROUTING_KEYS.items():
        stated = meta.get(f"{arch}.{key}")
        if stated is not None and stated not in neutral:
            raise ModelFileError(f"the file states {arch}.{key} {stated!r}, which the stage worker does not route by")
    norm = meta.get(f"{arch}.expert_weights_norm")
    if norm is not None and bool(norm) != rule.renormalise:
        raise ModelFileError(
            f"the file states {arch}.expert_weights_norm {norm!r}; {arch}'s experts are "
            f"{'' if rule.renormalise else 'not '}renormalised (as llama.cpp runs them)"
        )
    return ExpertFields(
        n_expert=count,
        n_expert_used=used,
        # llama.cpp's llama files give experts the feed-forward width; Qwen's state theirs
        expert_ffn_dim=int(_number(meta, f"{arch}.expert_feed_forward_length", ffn_dim) or 0),
        renormalise_experts=rule.renormalise,
    )
