"""How the endpoints are routed: the API key check, and `json_post`, which serves a handler of
one JSON body as a plain Starlette route rather than a FastAPI path operation.

FastAPI's path operation solves the handler's dependencies, parses its content type with the
`email` package and encodes a dict answer again on every request: with a stand-in engine, a
one-event streamed completion cost the app 325 µs of CPU as a plain route against 427 µs as a
path operation (bench/request_path.py). The generation endpoints, which every request for
tokens goes through, skip it: `json_post` reads the body as FastAPI reads a body parameter
(JSON when its content type says so; the same refusals, raised as RequestValidationError for
the app's handler), checks the API key as the other routes' dependency does (before reading
the body), and sends a dict as JSON.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from serving.openai.errors import APIError, ClientDisconnected

Body = TypeVar("Body", bound=BaseModel)
Handler = Callable[[Body, Request], Awaitable[Any]]


async def check_api_key(request: Request) -> None:
    """401 unless the request carries the server's API key (when it has one)."""
    key = request.app.state.server.limits.api_key
    if key is None:
        return
    given = request.headers.get("authorization", "")
    token = given.removeprefix("Bearer ").strip() if given.startswith("Bearer ") else ""
    if not secrets.compare_digest(token.encode(), key.encode()):
        raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')")


def json_post(
    router: APIRouter, path: str, model: type[Body]
) -> Callable[[Handler[Body]], Handler[Body]]:
    """Registers the decorated `handler(body, request)` for POST `path` on `router`, behind the
    API key, with the request's body validated as `model`; a dict it returns is sent as JSON,
    a Response as it is."""

    def register(handler: Handler[Body]) -> Handler[Body]:
        async def endpoint(request: Request) -> Response:
            await check_api_key(request)
            answer = await handler(await read_body(request, model), request)
            return answer if isinstance(answer, Response) else JSONResponse(answer)

        router.add_route(path, endpoint, methods=["POST"])
        return handler

    return register


async def read_body(request: Request, model: type[Body]) -> Body:
    """The body as `model`, as FastAPI reads a body parameter: parsed as JSON when its content
    type is JSON (application/json or application/*+json), else left as bytes, which no model
    accepts; each refusal a RequestValidationError."""
    try:
        raw = await request.body()
    except ClientDisconnect:
        raise ClientDisconnected() from None
    if not raw:
        raise RequestValidationError([_missing_body()])
    data: Any = raw
    if _is_json(request.headers.get("content-type", "")):
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as e:
            raise RequestValidationError([_malformed(e)]) from None
    try:
        return model.model_validate(data, from_attributes=True)  # as FastAPI validates a body
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False)) from None


def _is_json(content_type: str) -> bool:
    mime = content_type.partition(";")[0].strip().lower()
    kind, _, subtype = mime.partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


def _missing_body() -> dict[str, Any]:
    return {"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}


def _malformed(e: json.JSONDecodeError) -> dict[str, Any]:
    return {
        "type": "json_invalid",
        "loc": ("body", e.pos),
        "msg": "JSON decode error",
        "input": {},
        "ctx": {"error": e.msg},
    }
