"""The HTTP edge: thin FastAPI routes over the serving object, and the one place errors become responses.

Routes parse, authenticate and delegate. Every GatewayError (and FastAPI's own validation, 404 and 405 errors) is
rendered once, here, as OpenAI's {"error": {...}} body with Retry-After where it applies. A non-streaming request
runs beside a watcher of the client's connection, so a client that hangs up cancels its generation at once instead
of holding its lane to the end; a streaming one is cancelled by Starlette when the send fails. With an election, a
replica that does not coordinate relays completions to the one that does (strata.gateway.forwarding).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from strata.gateway import protocol as p
from strata.gateway.errors import (
    AuthenticationError,
    GatewayError,
    InvalidRequestError,
    MethodNotAllowedError,
    NotReadyError,
    RequestTooLargeError,
    RouteNotFoundError,
)
from strata.gateway.forwarding import Local, Relay
from strata.gateway.serving import Serving

T = TypeVar("T")
DEFAULT_MAX_BODY_BYTES = 8 << 20


def error_response(error: GatewayError) -> JSONResponse:
    return JSONResponse(status_code=error.status, content=error.body(), headers=error.headers())


class BodyLimit:
    """413 for a body over `max_bytes`, whether it says its length up front or streams in chunks."""

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = RequestTooLargeError(f"the request body is larger than {self.max_bytes} bytes")
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await error_response(too_large)(scope, receive, send)
                return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise too_large
            return message

        await self.app(scope, counted, send)


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        continue


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work`; None when the client hung up first, which cancels the work (its generation frees the lane)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return None
    return task.result()


def _respond(result: BaseModel | AsyncIterator[str] | None) -> Response:
    if result is None:  # the client is gone; nobody reads this
        return Response(status_code=499)
    if isinstance(result, BaseModel):
        return JSONResponse(result.model_dump(mode="json"))
    return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def create_app(
    serving: Serving,
    *,
    api_keys: frozenset[str] = frozenset(),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    lifespan_hooks: tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]] | None = None,
    relay: Relay | None = None,
) -> FastAPI:
    """The gateway app; `lifespan_hooks` (start, stop) run with the server (the pipeline's driver, say); `relay`
    forwards completions to the coordinating replica while this one stands by (None: no election)."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if lifespan_hooks is not None:
            await lifespan_hooks[0]()
        try:
            yield
        finally:
            if lifespan_hooks is not None:
                await lifespan_hooks[1]()

    app = FastAPI(title="Strata gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)

    def authenticate(request: Request) -> None:
        if not api_keys:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(given.encode(), k.encode()) for k in api_keys):
            raise AuthenticationError("a valid API key is required (Authorization: Bearer KEY)")

    authenticated = [Depends(authenticate)]

    async def relayed(request: Request, *, stream: bool) -> Response | None:
        """The coordinator's answer when this replica stands by; None when it serves the request itself."""
        if relay is None or isinstance(to := relay.route(request), Local):
            return None
        if stream:
            return await relay.forward(to, request, stream=True)
        answer = await cancel_on_disconnect(request, relay.forward(to, request, stream=False))
        return Response(status_code=499) if answer is None else answer

    @app.exception_handler(GatewayError)
    async def gateway_error(_request: Request, error: GatewayError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, error: RequestValidationError) -> JSONResponse:
        first: dict[str, Any] = error.errors()[0] if error.errors() else {}
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(location) or None
        message = f"{param}: {first.get('msg', 'invalid')}" if param else str(first.get("msg", "invalid body"))
        return error_response(InvalidRequestError(message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, error: StarletteHTTPException) -> JSONResponse:
        kinds: dict[int, type[GatewayError]] = {404: RouteNotFoundError, 405: MethodNotAllowedError}
        kind = kinds.get(error.status_code, InvalidRequestError)
        return error_response(kind(str(error.detail)))

    @app.get("/v1/models", dependencies=authenticated)
    async def list_models() -> JSONResponse:
        return JSONResponse(serving.models().model_dump(mode="json"))

    @app.get("/v1/models/{model_id:path}", dependencies=authenticated)
    async def get_model(model_id: str) -> JSONResponse:
        return JSONResponse(serving.model(model_id).model_dump(mode="json"))

    @app.post("/v1/chat/completions", dependencies=authenticated)
    async def chat_completions(body: p.ChatCompletionRequest, request: Request) -> Response:
        if (answer := await relayed(request, stream=bool(body.stream))) is not None:
            return answer
        if body.stream:
            return _respond(await serving.chat(body))
        return _respond(await cancel_on_disconnect(request, serving.chat(body)))

    @app.post("/v1/completions", dependencies=authenticated)
    async def completions(body: p.CompletionRequest, request: Request) -> Response:
        if (answer := await relayed(request, stream=bool(body.stream))) is not None:
            return answer
        if body.stream:
            return _respond(await serving.complete(body))
        return _respond(await cancel_on_disconnect(request, serving.complete(body)))

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        if relay is not None and not relay.coordinating:
            if relay.coordinator is None:
                raise NotReadyError("standby: no coordinating gateway replica is known yet", retry_after_s=1)
            return JSONResponse({"status": f"standby, forwarding to the coordinator at {relay.coordinator}"})
        if not serving.accepting:
            raise NotReadyError(f"no pipeline serves: {serving.pipelines.not_ready_reason}", retry_after_s=1)
        return JSONResponse({"status": "ready" if serving.pipelines.ready else "holding requests for a cold start"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(serving.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
