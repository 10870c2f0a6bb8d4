"""`json_post` reads a body as FastAPI reads a body parameter: the same request, sent to a
FastAPI path operation and to a `json_post` route on one app, is accepted by both or refused
by both with the same status, message and param."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest
from fastapi import APIRouter, FastAPI
from pydantic import BaseModel, ConfigDict

from serving.openai.errors import install_error_handlers
from serving.openai.routing import json_post


class Body(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)

    prompt: str
    n: int = 1


def _app() -> FastAPI:
    app = FastAPI()
    app.state.server = SimpleNamespace(limits=SimpleNamespace(api_key=None))
    install_error_handlers(app)

    @app.post("/path-operation")
    async def path_operation(body: Body) -> dict[str, object]:
        return body.model_dump()

    router = APIRouter()

    @json_post(router, "/json-post", Body)
    async def plain(body: Body, request: object) -> dict[str, object]:
        return body.model_dump()

    app.include_router(router)
    return app


JSON = b'{"prompt": "hi", "n": 2}'
CASES = [  # (content type or None for no header, body)
    ("application/json", JSON),
    ("application/json; charset=utf-8", JSON),
    ("Application/JSON", JSON),
    ("application/vnd.example+json", JSON),
    ("text/plain", JSON),
    ("application/x-www-form-urlencoded", JSON),
    ("application/jsonx", JSON),
    (None, JSON),
    ("application/json", b""),
    ("application/json", b'{"prompt": '),
    ("application/json", b"[1, 2]"),
    ("application/json", b'{"n": 2}'),
    ("application/json", b'{"prompt": "hi", "n": "two"}'),
    ("application/json", b'{"prompt": "hi", "n": NaN}'),
    ("application/json", b'"just a string"'),
]


@pytest.mark.parametrize(("content_type", "body"), CASES)
def test_json_post_reads_a_body_as_fastapi_does(content_type: str | None, body: bytes) -> None:
    async def main() -> None:
        transport = httpx.ASGITransport(app=_app())
        headers = {} if content_type is None else {"content-type": content_type}
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            fastapi = await client.post("/path-operation", content=body, headers=headers)
            ours = await client.post("/json-post", content=body, headers=headers)
        assert ours.status_code == fastapi.status_code, (ours.text, fastapi.text)
        assert ours.json() == fastapi.json()

    asyncio.run(main())


def test_the_cases_include_both_outcomes() -> None:
    """The comparison above means something only if some cases pass and some are refused."""

    async def main() -> set[int]:
        transport = httpx.ASGITransport(app=_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            statuses = set()
            for content_type, body in CASES:
                headers = {} if content_type is None else {"content-type": content_type}
                statuses.add(
                    (await client.post("/json-post", content=body, headers=headers)).status_code
                )
            return statuses

    assert asyncio.run(main()) == {200, 400}
