"""The benchmark scripts import and parse their arguments (running them takes minutes)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_bench(*args: str, timeout: float = 600) -> str:
    """Runs `python bench/...` as a user would; on failure the assertion shows its stderr."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stderr[-4000:]}"
    return done.stdout


@pytest.mark.parametrize("folder", ["bench", "bench/gpu"])
def test_no_script_shadows_an_installed_module(folder: str) -> None:
    """`python bench/x.py` puts bench/ first on sys.path, so bench/kernels.py once hid the
    `kernels` package that transformers 5.25 imports: every bench that loads transformers broke."""
    names = [p.stem for p in (ROOT / folder).glob("*.py") if p.stem != "__init__"]
    shadowed = [n for n in names if importlib.util.find_spec(n) is not None]
    assert not shadowed, f"{folder}/ modules named like installed ones: {shadowed}"


@pytest.mark.parametrize(
    "script",
    [
        "startup.py",
        "weights_dtype.py",
        "host_overhead.py",
        "structured.py",
        "speculative.py",
        "event_stream.py",
        "request_path.py",
    ],
)
def test_help(script: str) -> None:
    assert "--write-results" in run_bench(str(ROOT / "bench" / script), "--help", timeout=60)


def test_lora_smoke() -> None:
    """bench/lora.py end to end on a tiny random model (the real run is SmolLM2's)."""
    out = run_bench(str(ROOT / "bench" / "lora.py"), "--smoke")
    assert "| spread over 4 adapters |" in out
    assert "| adapter read and written into a slot first |" in out


def test_speculative_smoke() -> None:
    """bench/speculative.py end to end on a tiny random model (the real run is SmolLM2's)."""
    out = run_bench(str(ROOT / "bench" / "speculative.py"), "--smoke")
    assert "| copy-heavy | 1 | ngram k=3 |" in out
    assert "| random | 4 | off |" in out


def test_host_overhead_smoke() -> None:
    """bench/host_overhead.py's offline parts, (a) and (c), at one small size (no server)."""
    out = run_bench(
        str(ROOT / "bench" / "host_overhead.py"),
        *("--running", "4", "--steps", "2", "--warm-steps", "1", "--served"),
    )
    assert "| running seqs | schedule |" in out
    assert "| running seqs | sync steps/s | async steps/s |" in out


def test_host_overhead_closed_loop_smoke() -> None:
    """The offline rate the served rows are compared with: the served clients' requests
    stepped without a server, new requests joining as others end."""
    out = run_bench(
        "-c",
        "from bench import host_overhead as h; "
        "loop = h.ClosedLoop(h.write_checkpoint(), 4); "
        "rate, cpu_ms, phases = loop.window(0.2); loop.close(); "
        "print(rate, cpu_ms, phases['build'], phases['step'])",
    )
    rate, cpu_ms, build, step = map(float, out.strip().splitlines()[-1].split())
    assert rate > 0 and cpu_ms > 0 and 0 < build < step, out[-2000:]


def test_step_breakdown_smoke() -> None:
    """bench/step_breakdown.py's three builds (as is, and each stand-in) on a tiny model. Each
    forward is passed every array: a stand-in that left the weights unused once had jit drop
    them from the call, and their dispatch counted as the products' cost."""
    out = run_bench(str(ROOT / "bench" / "step_breakdown.py"), "--smoke")
    arrays = re.findall(r"^[a-z ]+, 1 running: [\d.]+ ms a step, (\d+) arrays$", out, re.MULTILINE)
    assert len(arrays) == 3 and len(set(arrays)) == 1, out[-2000:]
    assert "| running | ms a step | ms a token | host | device step |" in out
    assert re.search(r"^\| 1 \| [\d.]+ \| [\d.]+ \| ", out, re.MULTILINE), out[-2000:]


def test_event_stream_smoke() -> None:
    """bench/event_stream.py end to end with few answers: both responses, each event count."""
    out = run_bench(
        str(ROOT / "bench" / "event_stream.py"),
        *("--events", "1", "3", "--answers", "20", "--rounds", "1"),
    )
    for count in (1, 3):
        for name in ("Starlette StreamingResponse", "EventStream"):
            assert re.search(rf"^\| {count} \| {name} \| -?[\d.]+ \(", out, re.MULTILINE), out


def test_request_path_smoke() -> None:
    """bench/request_path.py end to end with few requests: both routes, every request kind
    (it raises unless each request is answered 200)."""
    out = run_bench(
        str(ROOT / "bench" / "request_path.py"),
        *("--events", "1", "3", "--requests", "20", "--rounds", "1"),
    )
    for kind, count in [("streamed completion", 3), ("completion", 1), ("streamed chat", 1)]:
        for route in ("FastAPI path operation", r"json_post \(served\)"):
            assert re.search(rf"^\| {kind} \| {count} \| {route} \| [\d.]+ \(", out, re.M), out


@pytest.mark.parametrize("status", [200, 503])
def test_host_overhead_raw_client(status: int) -> None:
    """The served rows' load generator against a stand-in server answering in odd segments: a
    client's requests follow one another once each answer's last bytes arrive (its second
    request makes it steady); a status other than 200 fails it."""
    import asyncio

    from bench import host_overhead

    answer = (
        b"HTTP/1.1 %d OK\r\ntransfer-encoding: chunked\r\n\r\n" % status
        + b'10\r\ndata: {"a": 1}\n\n\r\n'
        + b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
    )
    requests: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while head := await reader.readuntil(b"\r\n\r\n"):
            length = re.search(rb"Content-Length: (\d+)", head)
            assert length is not None
            requests.append(await reader.readexactly(int(length.group(1))))
            for start in range(0, len(answer), 7):  # segments cut anywhere
                writer.write(answer[start : start + 7])
                await writer.drain()
                await asyncio.sleep(0)

    async def run() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        steady: set[int] = set()
        client = asyncio.create_task(
            host_overhead._stream_raw(f"http://127.0.0.1:{port}", 3, 4, steady)
        )
        try:
            while not steady and not client.done():
                await asyncio.sleep(0.01)
            if status != 200:
                with pytest.raises(RuntimeError, match="503"):
                    await asyncio.wait_for(client, 10)
                return
            assert steady == {3} and len(requests) >= 2
            first, second = (json.loads(r)["max_tokens"] for r in requests[:2])
            assert (first, second) == (150, 200)  # client 3 of 4: its first is shorter
        finally:
            client.cancel()
            server.close()

    asyncio.run(run())
