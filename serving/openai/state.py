"""What the HTTP handlers share: the engine (once loaded), its tokenizer, limits and metrics."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from engine.llm_engine import LLMEngine
from engine.request import RequestOutput, SamplingParams, validate_prompt, validate_token_ids
from engine.scheduler import context_length_error
from engine.tokenizer import Tokenizer
from serving.async_engine import AsyncEngine
from serving.openai.errors import APIError
from serving.openai.metrics import ServerMetrics


@dataclass(frozen=True)
class ServerLimits:
    api_key: str | None = None
    max_queued_requests: int = 1024  # requests waiting for their first token
    max_body_bytes: int = 8 * 2**20


class ServerState:
    """The app's state. The engine may be attached after the server starts (it answers 503
    "loading" until then), so that /health can report loading."""

    def __init__(self, served_model_name: str, limits: ServerLimits):
        self.served_model_name = served_model_name
        self.limits = limits
        self.created = int(time.time())
        self.async_engine: AsyncEngine | None = None
        self.tokenizer: Tokenizer | None = None
        self.num_queued = 0
        self.metrics = ServerMetrics(self._llm_engine, served_model_name)

    def attach(self, async_engine: AsyncEngine, tokenizer: Tokenizer) -> None:
        self.async_engine = async_engine
        self.tokenizer = tokenizer
        self.metrics.healthy()

    def _llm_engine(self) -> LLMEngine | None:
        return self.async_engine.engine if self.async_engine is not None else None

    # ---- checks, in the order handlers make them ---------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model")

    def ready(self) -> tuple[AsyncEngine, Tokenizer]:
        if self.async_engine is None or self.tokenizer is None:
            raise APIError(503, "the model is still loading; retry shortly")
        if not self.async_engine.is_healthy:
            raise APIError(503, "the engine is not serving (stopped or failed); see the logs")
        return self.async_engine, self.tokenizer

    @property
    def max_model_len(self) -> int:
        engine = self._llm_engine()
        assert engine is not None
        return engine.scheduler_config.max_model_len

    @property
    def vocab_size(self) -> int:
        engine = self._llm_engine()
        assert engine is not None
        return engine.cfg.vocab_size

    def check_prompt(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Everything the engine would refuse, refused before a stream begins."""
        validate_prompt(prompt_ids, self.vocab_size)
        validate_token_ids(params, self.vocab_size)
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            message = context_length_error(self.max_model_len, len(prompt_ids), params.max_tokens)
            raise APIError(400, message, param="input_tokens")

    def check_queue(self, num_requests: int) -> None:
        limit = self.limits.max_queued_requests
        if self.num_queued + num_requests > limit:
            raise APIError(503, f"server busy: more than {limit} requests are waiting; retry later")

    # ---- generation --------------------------------------------------------------------------

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, priority: int
    ) -> AsyncIterator[RequestOutput]:
        """The engine's stream for one prompt, counted as queued until its first token, with
        latency metrics observed."""
        async_engine, _ = self.ready()
        started = time.monotonic()
        first: float | None = None
        self.num_queued += 1
        try:
            async for output in async_engine.generate(
                request_id, prompt_ids, params, priority=priority
            ):
                if first is None:
                    first = time.monotonic()
                    self.num_queued -= 1
                    self.metrics.first_token(first - started)
                if output.finished:
                    self.metrics.finished(output, started, first, time.monotonic())
                yield output
        finally:
            if first is None:
                self.num_queued -= 1
