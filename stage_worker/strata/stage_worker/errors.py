"""Typed errors of the stage worker; the gRPC edge (strata.stage_worker.server) maps each to one status code."""

from __future__ import annotations


class StageError(Exception):
    """Base of every error a stage reports to its caller."""


class InvalidRequestError(StageError):
    """The call is malformed for this stage (wrong hidden size, missing token ids, ...): INVALID_ARGUMENT."""


class UnknownSlotError(InvalidRequestError):
    """The call names a slot this stage does not have."""


class ContextExceededError(InvalidRequestError):
    """A chunk leaves a gap in its slot or runs past the context."""


class PoolExhaustedError(StageError):
    """The shared KV pool has no free cells left: RESOURCE_EXHAUSTED."""


class StaleTermError(StageError):
    """A coordinator with an older term (or another holder of the same term) called: FAILED_PRECONDITION."""


class WrongGenerationError(StageError):
    """The call belongs to another plan generation: FAILED_PRECONDITION."""


class NotLoadedError(StageError):
    """The weights are still loading, or loading failed: UNAVAILABLE."""


class NextStageUnavailableError(StageError):
    """The next stage could not be reached or dropped the stream: UNAVAILABLE, so the caller may retry."""


class ModelFileError(StageError):
    """The GGUF file lacks a tensor or key the stage needs, or holds an unsupported architecture."""


class NonFiniteLogitsError(StageError):
    """The stage's layers computed NaN or infinite logits: a numerical fault here, not the caller's (INTERNAL)."""
