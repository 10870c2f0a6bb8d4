"""One `xlaserve serve` process over the tiny checkpoint, shared by the HTTP tests."""

from __future__ import annotations

import pytest

from tests.engine.tiny_model import write_tiny_checkpoint
from tests.serving.openai_server import API_KEY, running_server


@pytest.fixture(scope="session")
def openai_server(tmp_path_factory, request):
    directory = write_tiny_checkpoint(tmp_path_factory.mktemp("served") / "tiny")
    # Compiled steps persist across test runs here, so only the first run compiles.
    cache_provider = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    cache = (
        cache_provider.mkdir("xla-compilation-cache")
        if cache_provider is not None
        else tmp_path_factory.mktemp("xla-compilation-cache")
    )
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with running_server(
        directory, cache, log, "--api-key", API_KEY, "--max-request-bytes", "1MiB"
    ) as server:
        yield server
