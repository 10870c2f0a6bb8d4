"""One `xlaserve serve` process over the tiny checkpoint, shared by the HTTP tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.tiny_model import write_tiny_checkpoint
from tests.serving.openai_server import API_KEY, running_server


def compilation_cache_dir(request, tmp_path_factory) -> Path:
    """Where served test engines keep compiled steps: they persist across test runs (and are
    shared by every server of the tiny checkpoint), so only the first run compiles."""
    cache_provider = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    if cache_provider is None:
        return Path(tmp_path_factory.getbasetemp()) / "xla-compilation-cache"
    return Path(cache_provider.mkdir("xla-compilation-cache"))


@pytest.fixture(scope="session")
def openai_server(tmp_path_factory, request):
    directory = write_tiny_checkpoint(tmp_path_factory.mktemp("served") / "tiny")
    cache = compilation_cache_dir(request, tmp_path_factory)
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with running_server(
        directory, cache, log, "--api-key", API_KEY, "--max-request-bytes", "1MiB"
    ) as server:
        yield server


SMOLLM2 = "smollm2-135m"


@pytest.fixture(scope="session")
def smollm2_server(tmp_path_factory, request):
    """One `xlaserve serve` of the real SmolLM2-135M-Instruct GGUF, shared by the tests that
    need it: Hermes tools (whose template renders a conversation without tools as SmolLM2's own
    does), 8 sequences and 64 tokens a step, prompts of tool listings up to 768 tokens."""
    from engine.weights import resolve_model

    resolve_model(SMOLLM2)  # finds the file once, before the server's clock starts
    cache_provider = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    cache = (
        Path(cache_provider.mkdir("xla-compilation-cache-smollm2"))
        if cache_provider is not None
        else tmp_path_factory.mktemp("xla-cache-smollm2")
    )
    log = tmp_path_factory.mktemp("logs") / "smollm2-server.log"
    extra = ["--served-model-name", SMOLLM2, "--max-num-seqs", "8"]
    extra += ["--max-num-batched-tokens", "64", "--kv-cache-memory", "256MiB"]
    extra += ["--max-model-len", "768"]  # the tools' listing makes long prompts
    extra += ["--chat-template", "hermes", "--tool-call-parser", "hermes"]
    with running_server(SMOLLM2, cache, log, *extra) as running:  # type: ignore[arg-type]
        yield running
