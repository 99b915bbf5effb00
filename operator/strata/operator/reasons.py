"""Every reason a ModelDeployment's conditions can carry, which condition carries it, and what a person can do.

Reasons are constants a script can rely on (the API conventions' CamelCase reasons); the README's list of them is
generated from `REASONS` (`make crds`), so a reason added here is documented the next time the section is written.
An unreadable model has one reason per cause, chosen from the typed error in strata.operator.models.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum

from strata.operator.status import ConditionType


class Reason(StrEnum):
    PLANNED = "Planned"
    INVALID_SPEC = "InvalidSpec"
    TOKEN_SECRET_UNREADABLE = "TokenSecretUnreadable"  # noqa: S105 - a reason, not a secret
    MODEL_NOT_FOUND = "ModelNotFound"
    MODEL_ACCESS_DENIED = "ModelAccessDenied"
    MODEL_GATED = "ModelGated"
    MODEL_UNREACHABLE = "ModelUnreachable"
    MODEL_TLS_FAILED = "ModelTLSFailed"
    MODEL_RANGE_IGNORED = "ModelRangeIgnored"
    MODEL_NOT_GGUF = "ModelNotGGUF"
    MODEL_HEADER_TRUNCATED = "ModelHeaderTruncated"
    MODEL_HEADER_INVALID = "ModelHeaderInvalid"
    MODEL_UNREADABLE = "ModelUnreadable"
    MODEL_NOT_EXECUTABLE = "ModelNotExecutable"
    OVERRIDE_CANNOT_FIT = "OverrideCannotFit"
    NO_PLAN_FITS = "NoPlanFits"
    FITS = "Fits"
    SHORTFALL = "Shortfall"
    LOADING = "Loading"
    LOAD_FAILED = "LoadFailed"
    AVAILABLE = "Available"
    UNAVAILABLE = "Unavailable"
    READY = "Ready"  # StagesReady's and Ready's
    NOT_READY = "NotReady"
    SCALED_TO_ZERO = "ScaledToZero"  # StagesReady's and Ready's while replicas is 0


_P, _C, _S, _G, _R = (
    ConditionType.PLANNED,
    ConditionType.CAPACITY_AVAILABLE,
    ConditionType.STAGES_READY,
    ConditionType.GATEWAY_READY,
    ConditionType.READY,
)

# (condition, reason) -> what it means and what to do; the order is the README's.
REASONS: Mapping[tuple[ConditionType, Reason], str] = {
    (_P, Reason.PLANNED): "A placement was found and its children applied (True).",
    (_P, Reason.INVALID_SPEC): "The spec passed the API server but not the operator's model; fix the field named.",
    (_P, Reason.TOKEN_SECRET_UNREADABLE): "`model.tokenSecretRef` names a Secret or key that cannot be read.",
    (_P, Reason.MODEL_NOT_FOUND): "No file at the URL or path (HTTP 404 or 410): check the URL and revision.",
    (_P, Reason.MODEL_ACCESS_DENIED): "The server refused the token or wants one (HTTP 401 or 403).",
    (_P, Reason.MODEL_GATED): "A gated Hugging Face repository: the token's account must accept its terms.",
    (_P, Reason.MODEL_UNREACHABLE): "The host does not resolve, refuses connections, times out or is unavailable.",
    (_P, Reason.MODEL_TLS_FAILED): "The TLS handshake failed: an untrusted certificate or no TLS on that port.",
    (_P, Reason.MODEL_RANGE_IGNORED): "The server ignores HTTP Range requests; Strata never downloads a whole model.",
    (_P, Reason.MODEL_NOT_GGUF): "The file does not start with the GGUF magic bytes.",
    (_P, Reason.MODEL_HEADER_TRUNCATED): "The file ends before its GGUF header does.",
    (_P, Reason.MODEL_HEADER_INVALID): "The header is malformed or hostile (a bound exceeded, an unknown type).",
    (_P, Reason.MODEL_UNREADABLE): "The header could not be read for another reason; the message says which.",
    (_P, Reason.MODEL_NOT_EXECUTABLE): "Strata's stages do not run the model (the check `strata inspect` shows).",
    (_P, Reason.OVERRIDE_CANNOT_FIT): "An explicit context, cache type or stage limit cannot fit; the message says "
    "the largest that does.",
    (_P, Reason.NO_PLAN_FITS): "No placement fits the pool (phase `Shortfall`); see `status.shortfall`.",
    (_C, Reason.FITS): "The newest plan's stages are placed (True).",
    (_C, Reason.SHORTFALL): "The pool lacks the GPU memory the model needs; the message says by how much.",
    (_S, Reason.READY): "Every stage of the newest plan is ready (True).",
    (_S, Reason.LOADING): "Stages are starting or loading their layers; `status.loadProgress` shows the bytes.",
    (_S, Reason.LOAD_FAILED): "A stage reported that its load failed; the message names the stage and its error.",
    (_S, Reason.SCALED_TO_ZERO): "`replicas` is 0: no stage runs; a request to the gateway brings one back.",
    (_G, Reason.AVAILABLE): "The gateway has an available replica (True).",
    (_G, Reason.UNAVAILABLE): "No gateway replica is available yet.",
    (_R, Reason.READY): "The serving generation and its gateway answer requests (True).",
    (_R, Reason.NOT_READY): "Not serving yet, or no longer; the message says which generation serves.",
    (_R, Reason.SCALED_TO_ZERO): "No pipeline runs (phase `ScaledToZero`); the gateway holds the next request "
    "while one loads.",
}

# A model that cannot be read now may be readable later (a server back up, a Secret created): these are retried
# with a growing delay, the others wait for the spec to change.
RETRIED = frozenset(
    {
        Reason.TOKEN_SECRET_UNREADABLE,
        Reason.MODEL_NOT_FOUND,
        Reason.MODEL_ACCESS_DENIED,
        Reason.MODEL_GATED,
        Reason.MODEL_UNREACHABLE,
        Reason.MODEL_TLS_FAILED,
        Reason.MODEL_RANGE_IGNORED,
        Reason.MODEL_NOT_GGUF,
        Reason.MODEL_HEADER_TRUNCATED,
        Reason.MODEL_HEADER_INVALID,
        Reason.MODEL_UNREADABLE,
    }
)
