"""The gateway container's speculative-decoding environment, from spec.speculative (strata.gateway.settings reads it).

Method draft runs the draft model in each gateway pod's own process. The draft reaches the pod as the model reaches
a stage pod: by its URL (spec.speculative.draftModel, the same source forms as spec.model), read by the process that
needs it, with a bearer token taken from its Secret when one is named. Nothing is mounted.
"""

from __future__ import annotations

from typing import Any

from strata.operator.spec_speculative import Speculative

EnvVar = dict[str, Any]


def speculative_env(speculative: Speculative | None) -> list[EnvVar]:
    """STRATA_SPECULATIVE and the options of its method; none when speculation is off."""
    if speculative is None:
        return []
    values: dict[str, object] = {
        "STRATA_SPECULATIVE": speculative.method.value,
        "STRATA_MAX_DRAFT": speculative.max_draft,
        "STRATA_MIN_DRAFT": speculative.min_draft,
    }
    source = speculative.draft_model
    if source is not None:
        values["STRATA_DRAFT_MODEL_URL"] = source.url
    if speculative.p_min is not None:
        values["STRATA_P_MIN"] = speculative.p_min
    if speculative.position_cost is not None:
        values["STRATA_POSITION_COST"] = speculative.position_cost
    env: list[EnvVar] = [{"name": key, "value": str(value)} for key, value in values.items()]
    if source is not None and source.token_secret_ref is not None:
        ref = source.token_secret_ref
        secret = {"secretKeyRef": {"name": ref.name, "key": ref.key}}
        env.append({"name": "STRATA_DRAFT_MODEL_TOKEN", "valueFrom": secret})
    return env
