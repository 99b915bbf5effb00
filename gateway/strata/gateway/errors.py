"""Typed errors of the gateway; app.py maps each to one OpenAI-shaped response, in one place.

Every error carries what the OpenAI body needs (status, type, code, param) so routes and the serving object raise
and never build responses themselves: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations


class GatewayError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}


class InvalidRequestError(GatewayError):
    """A parameter is malformed or out of range: 400 naming the parameter."""

    status = 400
    type = "invalid_request_error"


class ContextLengthExceededError(InvalidRequestError):
    code = "context_length_exceeded"


class AuthenticationError(GatewayError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class ModelNotFoundError(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class RouteNotFoundError(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class MethodNotAllowedError(GatewayError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class RequestTooLargeError(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class RateLimitedError(GatewayError):
    """Every lane is busy and the queue is full, or the wait for a lane expired."""

    status = 429
    type = "requests"
    code = "rate_limit_exceeded"


class ChatTemplateError(GatewayError):
    """The model's chat template failed or tried to leave its sandbox; nothing it asked for ran."""

    status = 500
    code = "chat_template_error"


class NotReadyError(GatewayError):
    """The pipeline is loading, unreachable, or this gateway lost the right to drive it: retry later."""

    status = 503
    code = "service_unavailable"


class PipelineError(GatewayError):
    """A stage failed mid-generation in a way a retry will not fix."""

    status = 500
    code = "pipeline_error"


class ColdStartTimeoutError(NotReadyError):
    """No pipeline came to serve within the cold-start wait: 503 with Retry-After and how far the load has got."""

    code = "cold_start"

    def __init__(self, message: str, *, retry_after_s: int, progress: dict[str, object]) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.progress = progress

    def body(self) -> dict[str, object]:
        return super().body() | {"progress": self.progress}
