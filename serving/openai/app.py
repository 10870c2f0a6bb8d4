"""The OpenAI-compatible HTTP app: `create_app(...)` builds it over an AsyncEngine (or none yet:
it answers 503 "loading" until `attach_engine`)."""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request, Response

from serving.admission import AdmissionLimit
from serving.front import Front
from serving.openai import chat, completions, lora
from serving.openai.errors import APIError, BodySizeLimit, install_error_handlers
from serving.openai.metrics import CONTENT_TYPE
from serving.openai.protocol import DetokenizeRequest, TokenizeRequest
from serving.openai.routing import check_api_key
from serving.openai.state import ReleaseAdmissions, ServerLimits, ServerState
from serving.openai.tool_use import ChatSettings

log = logging.getLogger(__name__)


def create_app(
    async_engine: Front | None,
    served_model_name: str,
    *,
    api_key: str | None = None,
    admission: AdmissionLimit | None = None,
    max_body_bytes: int = 8 * 2**20,
    allow_lora_updating: bool = False,
    chat_settings: ChatSettings | None = None,
) -> FastAPI:
    """`admission`: how many requests may run or wait at once (share it with a gRPC server on
    the same engine); None admits every request. `allow_lora_updating`: serve
    POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API key)."""
    app = FastAPI(title="xlaserve", docs_url=None, redoc_url=None, openapi_url=None)
    limits = ServerLimits(api_key, admission, max_body_bytes)
    app.state.server = ServerState(served_model_name, limits, chat_settings)
    if async_engine is not None:
        attach_engine(app, async_engine)
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    app.add_middleware(ReleaseAdmissions)
    guarded = [Depends(check_api_key)]  # json_post's routes check it themselves
    app.include_router(completions.router, dependencies=guarded)
    app.include_router(chat.router, dependencies=guarded)
    app.include_router(_api, dependencies=guarded)
    if allow_lora_updating:
        app.include_router(lora.router, dependencies=guarded)
    app.include_router(_open)
    _mount_chat_page(app)
    return app


def _mount_chat_page(app: FastAPI) -> None:
    # The chat page (serving/openai/static/) is written separately; serve it when present.
    if importlib.util.find_spec("serving.openai.static") is None:
        log.info("no chat page in this build (serving/openai/static is missing)")
        return
    from serving.openai.static import mount_chat_page

    mount_chat_page(app)


def attach_engine(app: FastAPI, async_engine: Front) -> None:
    """Makes a loaded engine serve (the app answers 503 "loading" until then)."""
    _state_of(app).attach(async_engine)


def _state_of(app: Any) -> ServerState:
    state: ServerState = app.state.server
    return state


_api = APIRouter()  # behind the API key
_open = APIRouter()  # health and metrics


@_api.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    state = _state_of(request.app)
    card: dict[str, Any] = {
        "id": state.served_model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "xlaserve",
    }
    adapters = []
    if state.async_engine is not None:
        card["max_model_len"] = state.max_model_len
        adapters = [
            {**card, "id": name, "root": name, "parent": state.served_model_name}
            for name in state.async_engine.engine.list_loras()
        ]
    return {"object": "list", "data": [card, *adapters]}


@_api.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    state = _state_of(request.app)
    state.check_model(body.model)
    _, tokenizer = state.ready()
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt")
    if body.messages is not None:
        ids = chat.chat_prompt_ids(
            tokenizer, body.messages, body.add_generation_prompt, state.chat.template
        )
    else:
        ids = tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}


@_api.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    state = _state_of(request.app)
    state.check_model(body.model)
    _, tokenizer = state.ready()
    bad = [t for t in body.tokens if t >= state.vocab_size]
    if bad:
        message = f"token id {bad[0]} is out of range for a vocabulary of {state.vocab_size}"
        raise APIError(400, message, param="tokens")
    return {"prompt": tokenizer.decode(body.tokens)}


@_open.get("/health")
async def health(request: Request) -> Response:
    # 503 with the reason (and Retry-After) while loading, and while the engine loop is dead,
    # stopping or stalled: no step finished for the step timeout while requests wait.
    _state_of(request.app).ready()
    return Response(status_code=200)


@_open.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_state_of(request.app).metrics.render(), media_type=CONTENT_TYPE)
