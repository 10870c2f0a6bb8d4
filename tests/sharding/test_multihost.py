"""Two processes with two CPU devices each (jax.distributed, gloo collectives on 127.0.0.1)
serve the tiny model over HTTP as one engine (TP=2 inside each process, PP=2 across them):
greedy outputs equal one process's, a constrained request answers one of its choices; a killed
follower turns the leader's /health to 503 within seconds, and the leader then exits by itself
with a one-line error."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.llm_engine import LLMEngine, run_to_completion
from engine.request import SamplingParams
from engine.tokenizer import load_tokenizer
from engine.weights import open_checkpoint, resolve_model
from tests.engine.tiny_model import write_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["Hello, world", "The quick brown fox", "abc"]
MAX_TOKENS = 6
START_TIMEOUT = 240.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_process(model: Path, process_id: int, coordinator: str, port: int, log: Path):
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(ROOT),
    }
    command = [
        sys.executable, "-m", "serving.cli", "serve", "--model", str(model), "--port", str(port),
        "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2",
        "--coordinator-address", coordinator, "--num-processes", "2",
        "--process-id", str(process_id), "--max-num-seqs", "1", "--max-num-batched-tokens", "4",
        "--max-model-len", "64", "--kv-cache-memory", "1MiB", "--compilation-cache-dir", "",
    ]  # fmt: skip
    return subprocess.Popen(
        command, env=env, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT
    )


def wait_healthy(url: str, processes: list[subprocess.Popen], logs: list[Path]) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        for p, log in zip(processes, logs, strict=True):
            if p.poll() is not None:
                pytest.fail(f"a server process exited early:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"not healthy after {START_TIMEOUT} s:\n{logs[0].read_text()[-3000:]}")


def one_process_outputs(model: Path) -> list[str]:
    checkpoint = open_checkpoint(resolve_model(str(model)))
    engine = LLMEngine(
        checkpoint.cfg,
        checkpoint.load_params(),
        load_tokenizer(model),
        cache_config=CacheConfig(page_size=16, num_pages=64),
        scheduler_config=SchedulerConfig(
            max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64
        ),
        warm_up=False,
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    return [
        o.outputs[0].text for o in run_to_completion(engine, [str(i) for i in range(len(PROMPTS))])
    ]


def test_two_processes_serve_like_one_and_fail_cleanly(tmp_path: Path) -> None:
    model = write_tiny_checkpoint(tmp_path / "tiny")
    coordinator, port = f"127.0.0.1:{free_port()}", free_port()
    logs = [tmp_path / "leader.log", tmp_path / "follower.log"]
    processes = [serve_process(model, i, coordinator, port, logs[i]) for i in (0, 1)]
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, processes, logs)
        response = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": PROMPTS, "max_tokens": MAX_TOKENS, "temperature": 0,
                  "ignore_eos": True},
            timeout=120,
        )  # fmt: skip
        assert response.status_code == 200, response.text
        choices = sorted(response.json()["choices"], key=lambda c: c["index"])
        assert [c["text"] for c in choices] == one_process_outputs(model)
        # A constrained request's batches carry a token bitmask (the others none): the step's
        # header tells the follower which, so that its broadcast matches the leader's.
        response = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": "abc", "max_tokens": 8, "temperature": 0,
                  "structured_outputs": {"choice": ["yes", "no"]}},
            timeout=120,
        )  # fmt: skip
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] in ("yes", "no")

        processes[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        status = 200
        while status == 200 and time.monotonic() - killed < 10:
            time.sleep(0.2)
            status = httpx.get(f"{url}/health", timeout=2).status_code
        assert status == 503
        print(f"/health 503 after {time.monotonic() - killed:.1f} s")
        code = processes[0].wait(timeout=60)
        output = logs[0].read_text()
        print(f"leader exited with {code} after {time.monotonic() - killed:.1f} s")
        assert code == 1, output[-3000:]
        assert "stopped responding" in output.splitlines()[-1], output[-3000:]
        assert "Traceback" not in output, output[-3000:]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:  # shown by pytest when the test fails
            print(f"---- {log.name}\n{log.read_text()[-4000:]}")
