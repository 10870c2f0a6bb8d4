"""serving.openai.generation.EventStream: a streamed answer that ends when its client goes."""

from __future__ import annotations

import asyncio

import pytest

from serving.openai.generation import EventStream


class Client:
    """The ASGI side of one connection: what was sent, and a disconnect on demand."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.gone = asyncio.Event()

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    @property
    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


def test_sends_every_event_then_the_end_and_leaves_no_cancel_behind() -> None:
    async def events():
        for i in range(3):
            yield b"data: %d\n\n" % i

    async def main() -> None:
        client = Client()
        await EventStream(events())({"type": "http"}, client.receive, client.send)
        client.gone.set()  # uvicorn's receive says disconnect once the answer is complete
        await asyncio.sleep(0.01)  # would raise CancelledError had the watcher cancelled us
        assert client.sent[0]["status"] == 200
        assert (b"content-type", b"text/event-stream; charset=utf-8") in client.sent[0]["headers"]
        assert client.bodies == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""]
        assert client.sent[-1]["more_body"] is False

    asyncio.run(main())


def test_a_disconnect_closes_the_events_and_ends_the_answer_quietly() -> None:
    closed = asyncio.Event()

    async def events():
        try:
            yield b"data: first\n\n"
            await asyncio.Event().wait()  # an engine request that has nothing more yet
            yield b"data: never\n\n"
        finally:
            closed.set()  # where a stream's generator aborts its engine request

    async def main() -> None:
        client = Client()
        answer = asyncio.create_task(
            EventStream(events())({"type": "http"}, client.receive, client.send)
        )
        await asyncio.sleep(0.01)
        client.gone.set()
        await asyncio.wait_for(answer, 5)  # returns: no CancelledError, no error
        assert closed.is_set() and answer.cancelling() == 0
        assert client.bodies == [b"data: first\n\n"]

    asyncio.run(main())


def test_a_cancel_from_elsewhere_still_cancels() -> None:
    async def events():
        yield b"data: first\n\n"
        await asyncio.Event().wait()

    async def main() -> None:
        client = Client()
        answer = asyncio.create_task(
            EventStream(events())({"type": "http"}, client.receive, client.send)
        )
        await asyncio.sleep(0.01)
        answer.cancel()  # the server's shutdown, past its grace period
        with pytest.raises(asyncio.CancelledError):
            await answer

    asyncio.run(main())
