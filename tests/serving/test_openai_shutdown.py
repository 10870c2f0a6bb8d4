"""SIGTERM: the server stops taking connections, lets a running stream finish, exits 0."""

from __future__ import annotations

import json
import signal

import httpx
import pytest

from tests.engine.tiny_model import write_tiny_checkpoint
from tests.serving.openai_server import running_server


def test_sigterm_lets_running_streams_finish(tmp_path, request) -> None:
    directory = write_tiny_checkpoint(tmp_path / "tiny")
    cache = request.config.cache.mkdir("xla-compilation-cache")
    body = {
        "prompt": "Bye",
        "max_tokens": 120,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with running_server(directory, cache, tmp_path / "server.log") as server:
        text, finish = "", None
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    server.process.send_signal(signal.SIGTERM)  # mid-stream
                    text += json.loads(line[6:])["choices"][0]["text"]
                    break
            rest = list(lines)
        for line in rest:
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text, finish = text + choice["text"], choice["finish_reason"] or finish
        assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"
        assert finish == "length"
        assert server.process.wait(timeout=30) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{server.url}/health")
    assert server.process.returncode == 0
