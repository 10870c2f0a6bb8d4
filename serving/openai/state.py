"""What the HTTP handlers share: the engine (once loaded), its tokenizer, limits and metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.protocol import Engine, ModelInfo
from engine.request import (
    RequestOutput,
    SamplingParams,
    context_length_error,
    validate_prompt,
    validate_token_ids,
)
from engine.tokenizer import Tokenizer
from serving.admission import Admission, AdmissionLimit
from serving.async_engine import LoopHealth
from serving.front import Front
from serving.openai.errors import APIError
from serving.openai.metrics import ServerMetrics
from serving.openai.tool_use import ChatSettings

LOADING_RETRY_AFTER_S = 5
_ADMISSIONS = "xlaserve.admissions"  # the ASGI scope's key for a request's admissions


@dataclass(frozen=True)
class ServerLimits:
    api_key: str | None = None
    admission: AdmissionLimit | None = None  # None: every request is admitted
    max_body_bytes: int = 8 * 2**20


class ServerState:
    """The app's state. The engine may be attached after the server starts (it answers 503
    "loading" until then), so that /health can report loading."""

    def __init__(
        self, served_model_name: str, limits: ServerLimits, chat: ChatSettings | None = None
    ):
        self.served_model_name = served_model_name
        self.limits = limits
        self.chat = chat or ChatSettings()
        self.created = int(time.time())
        self.async_engine: Front | None = None
        self.metrics = ServerMetrics(
            self._engine, served_model_name, self._loop_health, self._compilations
        )

    def attach(self, async_engine: Front) -> None:
        self.async_engine = async_engine
        self._model_info = async_engine.engine.model_info()
        self.metrics.healthy()

    def _engine(self) -> Engine | None:
        return self.async_engine.engine if self.async_engine is not None else None

    def _compilations(self) -> int:
        return self.async_engine.compilations() if self.async_engine is not None else 0

    def _loop_health(self) -> LoopHealth | None:
        return self.async_engine.health() if self.async_engine is not None else None

    # ---- checks, in the order handlers make them ---------------------------------------------

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter that `model` names (None: the base model); 404 for neither."""
        if model is None or model == self.served_model_name:
            return None
        engine = self._engine()
        if engine is not None and model in engine.list_loras():
            return model
        raise APIError(404, f"The model `{model}` does not exist.", param="model")

    def ready(self) -> tuple[Front, Tokenizer]:
        """503 (with the reason) while loading, and while the engine loop is dead, stopping or
        stalled (see AsyncEngine.health)."""
        if self.async_engine is None:
            message = "the model is still loading; retry shortly"
            raise APIError(503, message, retry_after=LOADING_RETRY_AFTER_S)
        health = self.async_engine.health()
        if not health.ok:
            raise APIError(503, f"the engine is not serving: {health.reason}")
        return self.async_engine, self.async_engine.engine.tokenizer

    @property
    def model_info(self) -> ModelInfo:
        """The attached engine's (handlers ask only after `ready`)."""
        return self._model_info

    @property
    def max_model_len(self) -> int:
        return self.model_info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.model_info.vocab_size

    def check_prompt(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Everything the engine would refuse, refused before a stream begins."""
        validate_prompt(prompt_ids, self.vocab_size)
        validate_token_ids(params, self.vocab_size)
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            message = context_length_error(self.max_model_len, len(prompt_ids), params.max_tokens)
            raise APIError(400, message, param="input_tokens")

    def admit(self, request: Request, num_requests: int) -> None:
        """Admits `num_requests` engine requests for this HTTP request, or raises
        ServerBusyError (503 with Retry-After) when the server holds as many as it may (see
        serving/admission.py). Checked and counted at once, with nothing awaited in between;
        `ReleaseAdmissions` gives them back when the request's answer has been sent, or has
        failed, or its client went away, even if a stream was never iterated."""
        if self.limits.admission is None:
            return
        admissions = request.scope.get(_ADMISSIONS)
        assert admissions is not None, "the app must run under ReleaseAdmissions"
        admissions.append(self.limits.admission.admit(num_requests))

    async def compile_grammar(self, params: SamplingParams) -> None:
        """A structured-output grammar compiled (on the engine's compiler threads) before a
        stream begins, so that one that fails is a 400 naming the problem."""
        if params.structured_outputs is not None:
            async_engine, _ = self.ready()
            spec = params.structured_outputs
            await asyncio.wrap_future(async_engine.engine.compile_grammar(spec))

    # ---- generation --------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        priority: int,
        lora_name: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The engine's stream for one prompt (with the LoRA adapter `lora_name`, if given),
        with latency metrics observed."""
        async_engine, _ = self.ready()
        started = time.monotonic()
        first: float | None = None
        outputs = async_engine.generate(
            request_id, prompt_ids, params, priority=priority, lora_name=lora_name
        )
        async with aclosing(outputs):  # closing this stream aborts the request at once
            async for output in outputs:
                if first is None:
                    first = time.monotonic()
                    self.metrics.first_token(first - started)
                if output.finished:
                    self.metrics.finished(output, started, first, time.monotonic())
                yield output


class ReleaseAdmissions:
    """ASGI middleware: gives back what `ServerState.admit` took for a request once the app
    has finished with it: its answer (streamed or not) sent, an error answered, the client
    gone, or the task cancelled; an EventStream that never ran its body included."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        admissions: list[Admission] = []
        scope[_ADMISSIONS] = admissions
        try:
            await self.app(scope, receive, send)
        finally:
            for admission in admissions:
                admission.release()
