"""EngineCoreClient against a scripted core (the test plays the engine core's side of the pipe,
no engine): a core that goes silent while a request waits turns the client unhealthy after the
step timeout and healthy again when it speaks; a refused request raises its error with the
field named; a core that goes away ends the stream with EngineDeadError and is fatal."""

from __future__ import annotations

import asyncio
import multiprocessing
import time

import pytest

from engine.errors import InvalidRequestError
from engine.protocol import EngineStats, Health, ModelInfo
from engine.request import CompletionOutput, RequestOutput, SamplingParams
from serving import core_wire as wire
from serving.async_engine import EngineDeadError
from serving.core_client import EngineCoreClient

STEP_TIMEOUT = 0.5
INFO = ModelInfo("LlamaForCausalLM", 256, 128, 4, 32)


def _status() -> tuple:
    return (wire.STATUS, wire.CoreStatus(EngineStats(), Health(), (), 0.01, 0.0, 0))


@pytest.fixture
def pair():
    client_end, core_end = multiprocessing.Pipe()
    wire.send(core_end, [(wire.HELLO, INFO, None)])  # alone, as the core sends it
    wire.send(core_end, [_status()])
    client = EngineCoreClient.connect(client_end, step_timeout=STEP_TIMEOUT)
    yield client, core_end
    core_end.close()


def _until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_silent_core_with_work_is_unhealthy_until_it_speaks(pair) -> None:
    client, core = pair

    async def main() -> None:
        stream = client.generate("r", [1, 2], SamplingParams(max_tokens=2))
        first = asyncio.ensure_future(stream.__anext__())
        ((kind, request_id, *_),) = await asyncio.to_thread(wire.receive, core)
        assert (kind, request_id) == (wire.ADD, "r")
        assert client.health().ok
        await asyncio.sleep(STEP_TIMEOUT * 2)  # the core says nothing while "r" waits
        health = client.health()
        assert not health.ok and "sent nothing" in health.reason
        assert not client.engine.health().fatal
        delta = RequestOutput("r", [CompletionOutput(0, "a", [5])], finished=False)
        wire.send(core, [(wire.OUTPUTS, [wire.compact(delta)]), _status()])
        assert (await asyncio.wait_for(first, 5)).outputs[0].text == "a"
        assert client.health().ok
        await stream.aclose()  # an abort goes to the core
        ((kind, request_id),) = await asyncio.to_thread(wire.receive, core)
        assert (kind, request_id) == (wire.ABORT, "r")

    asyncio.run(main())


def test_an_idle_silent_core_stays_healthy(pair) -> None:
    client, _ = pair
    time.sleep(STEP_TIMEOUT * 2)
    assert client.health().ok


def test_a_refused_request_raises_its_error(pair) -> None:
    client, core = pair

    async def main() -> None:
        stream = client.generate("r", [1], SamplingParams())
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.to_thread(wire.receive, core)
        error = InvalidRequestError("lora_name 'x' is not registered", param="model")
        wire.send(core, [(wire.REFUSED, "r", error)])
        with pytest.raises(InvalidRequestError) as raised:
            await asyncio.wait_for(first, 5)
        assert raised.value.param == "model"

    asyncio.run(main())


def test_a_core_that_goes_away_ends_streams_and_is_fatal(pair) -> None:
    client, core = pair

    async def main() -> None:
        stream = client.generate("r", [1], SamplingParams())
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.to_thread(wire.receive, core)
        core.close()
        with pytest.raises(EngineDeadError, match="engine core process exited"):
            await asyncio.wait_for(first, 5)

    asyncio.run(main())
    _until(lambda: client.engine.health().fatal)
    assert not client.health().ok
    with pytest.raises(EngineDeadError):
        asyncio.run(client.generate("s", [1], SamplingParams()).__anext__())
