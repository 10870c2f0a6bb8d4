"""The error contract: every failure is `{"error": {"message", "type", "param", "code"}}` with the
HTTP status equal to `code`, OpenAI's shape, so that its clients raise the matching exception.

A client's input gives a 4xx (schema errors included: 400, never FastAPI's 422); only a bug in
the server gives a 500, logged with its traceback. Every 503 (loading, busy, engine not
serving) carries a Retry-After header.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.errors import InvalidRequestError, XlaserveError
from serving.admission import RETRY_AFTER_S, ServerBusyError
from serving.async_engine import EngineDeadError

log = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error to answer with: HTTP status, message, and the request field it concerns."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        retry_after: int = RETRY_AFTER_S,  # seconds, sent with a 503
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after = retry_after


class ClientDisconnected(Exception):
    """The client closed the connection before its answer was ready (nothing to answer)."""


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    error_type = ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


def error_response(error: APIError) -> JSONResponse:
    headers = {"Retry-After": str(error.retry_after)} if error.status == 503 else None
    body = error_body(error.status, error.message, error.param)
    return JSONResponse(body, status_code=error.status, headers=headers)


def as_api_error(error: Exception) -> APIError:
    """Any exception a handler may meet -> the APIError to report (500 for unknown ones)."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, InvalidRequestError):
        return APIError(400, str(error), param=error.param)
    if isinstance(error, (EngineDeadError, ServerBusyError)):
        return APIError(503, str(error))
    if isinstance(error, XlaserveError):  # chat template errors, tokenizer errors
        return APIError(400, str(error))
    log.error("unexpected error while serving a request", exc_info=error)
    return APIError(500, f"internal server error: {type(error).__name__}")


def install_error_handlers(app: FastAPI) -> None:
    async def on_error(request: Request, error: Exception) -> JSONResponse:
        return error_response(as_api_error(error))

    async def on_validation(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, RequestValidationError)
        message, param = describe_validation_errors(error.errors())
        return error_response(APIError(400, message, param=param))

    async def on_http(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, StarletteHTTPException)
        return error_response(APIError(error.status_code, str(error.detail)))

    async def on_disconnect(request: Request, error: Exception) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    app.add_exception_handler(ClientDisconnected, on_disconnect)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    for error_class in (APIError, XlaserveError, Exception):
        app.add_exception_handler(error_class, on_error)


def describe_validation_errors(errors: Sequence[Any]) -> tuple[str, str | None]:
    """pydantic's error list -> one message and the `param` of the first offending field."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}", None
    loc = [part for part in first.get("loc", ()) if part != "body"]
    param = _param_name(loc) or None
    where = f"{param}: " if param else "request body: "
    extra = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return f"{where}{first['msg']}{extra}", param


def _param_name(loc: Sequence[Any]) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'; union branch names are dropped."""
    name = ""
    for part in loc:
        if isinstance(part, int):
            name += f"[{part}]"
        elif not _is_type_tag(part):
            name += f".{part}" if name else str(part)
    return name


def _is_type_tag(part: str) -> bool:
    # pydantic names union branches like 'str', 'list[int]', 'function-after[...]'
    return part in ("str", "int", "float", "bool") or "[" in part or part.endswith("Part")


class BodySizeLimit:
    """ASGI middleware refusing bodies over `max_bytes` with 413 Payload Too Large (the HTTP
    status that says exactly this; OpenAI's clients map it to an APIStatusError), whether the
    size is announced in Content-Length or only found while reading a chunked body."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await _send_error(send, 413, self._message())
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise StarletteHTTPException(413, self._message())
            return message

        await self.app(scope, limited_receive, send)

    def _message(self) -> str:
        return f"request body is larger than the limit of {self.max_bytes} bytes"


async def _send_error(send: Send, status: int, message: str) -> None:
    body = json.dumps(error_body(status, message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
