"""Structured output's grammar compile timeout over HTTP (the OpenAI app in-process, on the
suite's tiny engine): a request whose grammar does not compile in time gets a 400 naming the
timeout while concurrent free requests finish with their offline tokens, and the server keeps
serving (a later request finds that grammar compiled). The grammar is made slow on purpose:
how long a real one takes depends on the machine."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import pytest

from engine.config import StructuredOutputConfig
from engine.llm_engine import LLMEngine, run_to_completion
from engine.request import SamplingParams
from engine.structured.compiler import GrammarCompiler
from engine.structured.spec import StructuredOutputs
from serving.async_engine import AsyncEngine
from serving.openai import create_app

TIMEOUT_S = 0.2
SLOW = StructuredOutputs(regex="slow [0-9]")
PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]


def offline(engine: LLMEngine) -> list[str]:
    """The free requests' greedy texts, the engine run alone (the oracle)."""
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ids = [f"offline{i}" for i in range(len(PROMPTS))]
    for request_id, prompt in zip(ids, PROMPTS, strict=True):
        engine.add_request(request_id, prompt, greedy)
    return [o.outputs[0].text for o in run_to_completion(engine, ids)]


@pytest.fixture
def slow_compiler(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch):
    """The engine's grammars compiled with a short timeout, SLOW taking longer than it; set
    when SLOW's compilation has finished (after its request's timeout)."""
    cfg, tokenizer = engine.cfg, engine.tokenizer
    compiler = GrammarCompiler(
        tokenizer, cfg.vocab_size, StructuredOutputConfig(compile_timeout_s=TIMEOUT_S)
    )
    compile_now, finished = compiler._compile, threading.Event()

    def slow_compile(spec: StructuredOutputs, ll_tokenizer: Any) -> Any:
        if spec != SLOW:
            return compile_now(spec, ll_tokenizer)
        time.sleep(5 * TIMEOUT_S)
        matcher = compile_now(spec, ll_tokenizer)
        finished.set()
        return matcher

    monkeypatch.setattr(compiler, "_compile", slow_compile)
    monkeypatch.setattr(engine.grammars, "compiler", compiler)
    yield finished
    compiler.close()


def test_compile_timeout_is_a_400_while_free_requests_finish(engine, slow_compiler) -> None:
    want = offline(engine)
    front = AsyncEngine(engine)
    app = create_app(front, "tiny")
    transport = httpx.ASGITransport(app=app)

    def body(prompt: list[int], **extra: Any) -> dict[str, Any]:
        return {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, **extra}  # fmt: skip

    async def main() -> tuple[list[httpx.Response], httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            post = lambda b: client.post("/v1/completions", json=b)
            slow = body([10, 11], guided_regex=SLOW.regex)
            *free, refused = await asyncio.gather(*(post(body(p)) for p in PROMPTS), post(slow))
            await asyncio.to_thread(slow_compiler.wait, 10)  # its compilation went on
            again = await post(slow)
            return free, refused, again

    try:
        free, refused, again = asyncio.run(main())
    finally:
        front.shutdown(timeout=5)
    assert [r.status_code for r in free] == [200] * len(PROMPTS)
    assert [r.json()["choices"][0]["text"] for r in free] == want
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["message"] == (
        f"regex: the regular expression did not compile within {TIMEOUT_S:g} s"
    ), error
    assert error["param"] == "regex"
    assert again.status_code == 200, again.text  # the server kept serving; now it is cached
    text = again.json()["choices"][0]["text"]
    assert text.startswith("slow ") and text[5:].isdigit(), text
