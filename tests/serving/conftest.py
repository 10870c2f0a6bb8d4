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
