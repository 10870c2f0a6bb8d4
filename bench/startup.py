"""Start-up time of `xlaserve serve` until the first streamed token, cold and warm.

    PYTHONPATH=. .venv/bin/python bench/startup.py [--model smollm2-135m] [--write-results]

Starts the server twice as a subprocess with one fresh --compilation-cache-dir: cold (the
directory is empty, every step bucket compiles) and warm (the same directory again, every
program loads from it). Each start is timed from the process's launch: /health is polled until
it answers 200, then one streaming completion is sent and the clock stops at its first token.
The server's own start-up log lines and its /metrics compilation counter are recorded; the
server is stopped after each start. The OS file cache is warm in both runs (the checkpoint was
read before): "cold" means an empty compilation cache, not a cold disk.
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import jax

from bench import common

TITLE = "Start-up to first token (bench/startup.py)"
SERVE_ARGS = ("--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--max-model-len", "2048")
PROMPT = "The capital of France is"
WARM_TARGET_S = 10.0
POLL_S = 0.05
_LOGGED_COMPILES = re.compile(r"(\d+) XLA compilations so far")
_METRIC_COMPILES = re.compile(r"^xlaserve:compilations_total\{[^}]*\} ([0-9.e+]+)$", re.M)


@dataclass
class Start:
    label: str
    health_s: float  # launch -> /health 200
    first_token_s: float  # launch -> first streamed token
    logged_compilations: int | None  # "N XLA compilations so far" at the end of start-up
    compilations: int | None  # /metrics after the request (start-up and the request)
    startup_log: list[str]

    def row(self) -> str:
        return (
            f"| {self.label} | {self.health_s:.1f} | {self.first_token_s:.1f} | "
            f"{_or_dash(self.logged_compilations)} | {_or_dash(self.compilations)} |"
        )


def _or_dash(value: int | None) -> str:
    return "-" if value is None else str(value)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_command(model: str, port: int, cache_dir: str) -> list[str]:
    """`xlaserve serve ...`, run as `python -m serving.cli` so that it is this checkout's code."""
    return [
        sys.executable,
        "-m",
        "serving.cli",
        "serve",
        "--model",
        model,
        "--port",
        str(port),
        "--compilation-cache-dir",
        cache_dir,
        *SERVE_ARGS,
    ]


def _get(port: int, path: str, timeout: float = 5.0) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def wait_healthy(port: int, server: subprocess.Popen[str], deadline: float) -> None:
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with status {server.returncode}")
        try:
            if _get(port, "/health", timeout=1.0)[0] == 200:
                return
        except OSError:
            pass  # not listening yet
        time.sleep(POLL_S)
    raise TimeoutError("/health did not answer 200 in time")


def first_token(port: int, model: str) -> str:
    """Sends one streaming completion; returns as soon as a chunk carries text."""
    body = json.dumps(
        {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}
    )
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"completion answered {response.status}: {response.read()!r}")
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk["choices"] and chunk["choices"][0].get("text"):
                return str(chunk["choices"][0]["text"])
        raise RuntimeError("the stream ended without a token")
    finally:
        conn.close()


def metric_compilations(port: int) -> int | None:
    match = _METRIC_COMPILES.search(_get(port, "/metrics")[1])
    return int(float(match.group(1))) if match else None


def start_once(label: str, model: str, cache_dir: str, timeout: float) -> Start:
    port = free_port()
    lines: list[str] = []
    launched = time.monotonic()
    server = subprocess.Popen(
        serve_command(model, port, cache_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert server.stdout is not None
    reader = threading.Thread(target=lambda: lines.extend(server.stdout or ()), daemon=True)
    reader.start()
    try:
        wait_healthy(port, server, launched + timeout)
        healthy = time.monotonic()
        first_token(port, model)
        token = time.monotonic()
        compilations = metric_compilations(port)
    except Exception:
        print("".join(lines), file=sys.stderr)
        raise
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        reader.join(timeout=5)
    startup = [line.strip() for line in lines if "start-up:" in line]
    logged = [int(m.group(1)) for line in startup if (m := _LOGGED_COMPILES.search(line))]
    return Start(
        label,
        healthy - launched,
        token - launched,
        logged[-1] if logged else None,
        compilations,
        startup,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per start")
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="xlaserve-startup-") as cache_dir:
        cold = start_once("cold (empty compilation cache)", args.model, cache_dir, args.timeout)
        entries = sum(1 for p in Path(cache_dir).rglob("*") if p.is_file())
        warm = start_once("warm (same cache)", args.model, cache_dir, args.timeout)

    verdict = "holds" if warm.first_token_s < WARM_TARGET_S else "does NOT hold"
    shown = serve_command(args.model, 0, "DIR")[3:]
    shown[shown.index("--port") + 1] = "PORT"
    lines = [
        *common.preamble(
            "PYTHONPATH=. .venv/bin/python bench/startup.py " + " ".join(sys.argv[1:]),
            {"jax": jax.__version__},
        ),
        f"- server: `xlaserve {' '.join(shown)}` (run as `python -m serving.cli`), "
        "DIR a fresh temporary directory shared by both starts",
        f"- request: one streaming `/v1/completions` of {PROMPT!r}, greedy, once /health "
        "answers 200; the clock runs from the process launch to the first chunk with text",
        "- the checkpoint is in the OS file cache in both starts; cold = empty compilation "
        f"cache ({entries} files in it after the cold start)",
        "",
        "| start | s to /health 200 | s to first token | compilations logged at start-up "
        "| compilations after the request (/metrics) |",
        "|---|---|---|---|---|",
        cold.row(),
        warm.row(),
        "",
        f"Target: warm start to first token under {WARM_TARGET_S:.0f} s: {verdict} "
        f"({warm.first_token_s:.1f} s).",
        "",
        "The server's start-up log lines (cold, then warm):",
        "",
        *(f"    {line}" for line in cold.startup_log + warm.startup_log),
    ]
    text = "\n".join(lines)
    print(text)
    if args.write_results:
        common.write_section(TITLE, text)


if __name__ == "__main__":
    main()
