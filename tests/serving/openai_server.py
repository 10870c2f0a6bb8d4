"""A real `xlaserve serve` process on 127.0.0.1 over the tiny checkpoint, for HTTP tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "test-key"
START_TIMEOUT = 420  # cold: loading plus compiling 18 buckets on a loaded 2-core machine


@dataclass
class Server:
    url: str
    model: str
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def api(self) -> str:
        return f"{self.url}/v1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def running_server(model_dir: Path, cache_dir: Path, log: Path, *extra: str) -> Iterator[Server]:
    port = free_port()
    command = [
        sys.executable, "-m", "serving.cli", "serve",
        "--model", str(model_dir), "--served-model-name", "tiny",
        "--port", str(port), "--max-num-seqs", "8", "--max-num-batched-tokens", "32",
        "--max-model-len", "256", "--kv-cache-memory", "16MiB",
        "--compilation-cache-dir", str(cache_dir), "--shutdown-timeout", "5", *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("wb") as out:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=out)
    server = Server(f"http://127.0.0.1:{port}", "tiny", process, log)
    try:
        _wait_healthy(server)
        yield server
    finally:
        _stop(process)
    assert process.returncode == 0, f"server exited with {process.returncode}:\n{_tail(log)}"


def _wait_healthy(server: Server) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited during start-up:\n{_tail(server.log)}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server not healthy after {START_TIMEOUT} s:\n{_tail(server.log)}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]
