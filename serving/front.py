"""What the HTTP and gRPC servers drive: `Front`, the asyncio face of an engine. Two implement
it: AsyncEngine (serving/async_engine.py: the engine on a thread of the server's own process)
and EngineCoreClient (serving/core_client.py: the engine in a process of its own)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Protocol, TypeVar

from engine.protocol import Engine
from engine.request import RequestOutput, SamplingParams
from serving.async_engine import LoopHealth

T = TypeVar("T")


class Front(Protocol):
    @property
    def engine(self) -> Engine:
        """What the servers may ask of the engine directly: its tokenizer, limits, gauges,
        health, adapters and grammar compiler (never its steps)."""
        ...

    @property
    def is_healthy(self) -> bool: ...

    def health(self) -> LoopHealth:
        """Whether the engine loop serves; any thread may ask."""
        ...

    def generate(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        lora_name: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's deltas; closing the generator early aborts the request."""
        ...

    async def run(self, work: Callable[[], T]) -> T:
        """`work()`, which changes the engine's state (a LoRA adapter), run between steps."""
        ...

    def abort(self, request_id: str) -> None: ...

    def compilations(self) -> int:
        """XLA compilations in the engine's process (for /metrics)."""
        ...

    def shutdown(self, timeout: float = 30.0) -> None:
        """Lets running requests finish for up to `timeout` seconds, aborts the rest, stops."""
        ...
