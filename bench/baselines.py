"""The baselines bench/compare.py runs next to xlaserve on the same GGUF and machine:
llama.cpp's server (llama-cpp-python[server], built from source into a venv of its own and cached)
and Hugging Face transformers (offline, static batches).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx

from bench.serve import RequestResult
from bench.workloads import BenchRequest

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "xlaserve"
LLAMACPP_VENV = CACHE / "bench-llamacpp-venv"
WHEELS = CACHE / "wheels"
# A native build dies with SIGILL in ggml's AMX matmul on these Xeons (shared/BASELINES.md):
# everything native except AMX.
_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
LLAMACPP_CMAKE_ARGS = f'-DGGML_NATIVE=ON -DCMAKE_C_FLAGS="{_NO_AMX}" -DCMAKE_CXX_FLAGS="{_NO_AMX}"'
# llama.cpp's own server, built from the llama.cpp vendored in the same llama-cpp-python release,
# so both baselines run one llama.cpp commit.
LLAMACPP_PYTHON_VERSION = "0.3.36"
LLAMA_SERVER_DIR = CACHE / f"llama-server-{LLAMACPP_PYTHON_VERSION}"


def llamacpp_python() -> Path:
    return LLAMACPP_VENV / "bin" / "python"


def llamacpp_installed() -> bool:
    python = llamacpp_python()
    if not python.exists():
        return False
    check = subprocess.run([python, "-c", "import llama_cpp.server"], capture_output=True)
    return check.returncode == 0


def install_llamacpp() -> None:
    """Builds llama-cpp-python once (about 9 minutes on 2 cores) into a wheel under
    ~/.cache/xlaserve/wheels, then installs it with its server extra into its own venv."""
    if llamacpp_installed():
        return
    if not llamacpp_python().exists():
        subprocess.run([sys.executable, "-m", "venv", LLAMACPP_VENV], check=True)
    pip = [str(llamacpp_python()), "-m", "pip"]
    if not list(WHEELS.glob("llama_cpp_python-*.whl")):
        env = {**os.environ, "CMAKE_ARGS": LLAMACPP_CMAKE_ARGS}
        build = [*pip, "wheel", "--no-deps", "--no-cache-dir", "-w", WHEELS, "llama-cpp-python"]
        subprocess.run(["nice", "-n", "10", *map(str, build)], env=env, check=True)
    wheel = sorted(WHEELS.glob("llama_cpp_python-*.whl"))[-1]
    subprocess.run([*pip, "install", f"{wheel}[server]"], check=True)


def llama_server() -> Path:
    return LLAMA_SERVER_DIR / "build" / "bin" / "llama-server"


def install_llama_server() -> None:
    """Builds llama.cpp's `llama-server` once (about 15 minutes on 2 cores, niced) from the
    llama.cpp vendored in llama-cpp-python's source package, into ~/.cache/xlaserve."""
    if llama_server().exists():
        return
    sdist_dir = LLAMA_SERVER_DIR / "sdist"
    sdist_dir.mkdir(parents=True, exist_ok=True)
    if not list(sdist_dir.glob("llama_cpp_python-*.tar.gz")):
        pin = f"llama-cpp-python=={LLAMACPP_PYTHON_VERSION}"
        download = [
            "download",
            "--no-deps",
            "--no-binary",
            "llama-cpp-python",
            "-d",
            str(sdist_dir),
            pin,
        ]
        subprocess.run([sys.executable, "-m", "pip", *download], check=True)
    sdist = sorted(sdist_dir.glob("llama_cpp_python-*.tar.gz"))[-1]
    subprocess.run(["tar", "-xzf", sdist, "-C", sdist_dir], check=True)
    source = next(sdist_dir.glob("llama_cpp_python-*/vendor/llama.cpp"))
    build = LLAMA_SERVER_DIR / "build"
    configure = [
        "cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=ON", f"-DCMAKE_C_FLAGS={_NO_AMX}", f"-DCMAKE_CXX_FLAGS={_NO_AMX}",
        "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF",
        "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    ]  # fmt: skip
    subprocess.run(configure, check=True)
    jobs = str(len(os.sched_getaffinity(0)))
    make = ["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs]
    subprocess.run(["nice", "-n", "10", *make], check=True)


def llama_server_command(
    model_file: Path, port: int, threads: int, slots: int, slot_len: int
) -> list[str]:
    """llama-server with `slots` parallel slots of `slot_len` tokens each, batching continuously
    (what llama.cpp's users run to serve many clients). Flash attention stays at its CPU
    default (shared/BASELINES.md: on, it slows CPU decode at depth)."""
    return [
        str(llama_server()), "-m", str(model_file), "-t", str(threads), "-tb", str(threads),
        "-np", str(slots), "-c", str(slots * slot_len), "--cont-batching",
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip


def llama_server_version() -> str:
    out = subprocess.run([llama_server(), "--version"], capture_output=True, text=True)
    lines = (out.stdout + out.stderr).strip().splitlines()
    version = next((line for line in lines if line.startswith("version")), "unknown")
    return f"llama-server {version} (from llama-cpp-python {LLAMACPP_PYTHON_VERSION})"


def llamacpp_version() -> str:
    out = subprocess.run(
        [llamacpp_python(), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() or "unknown"


@contextmanager
def server_process(command: Sequence[str], url: str, log: Path, timeout: float) -> Iterator[float]:
    """Starts a server, waits for `url` to answer 200 and yields the start-up seconds (load and
    warm-up); stops it with SIGTERM (then SIGKILL) on exit. Refuses to start while something
    answers at `url` already: a server left from an interrupted run would be measured instead,
    its own configuration unseen."""
    with suppress(httpx.TransportError):
        httpx.get(url, timeout=2)
        raise RuntimeError(f"something already answers at {url}: a server of an earlier run?")
    start = time.perf_counter()
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    with log.open("wb") as out:
        process = subprocess.Popen(list(command), cwd=root, env=env, stdout=out, stderr=out)
    try:
        _wait_ready(process, url, log, timeout)
        yield time.perf_counter() - start
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_ready(process: subprocess.Popen[bytes], url: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"server exited during start-up:\n{tail}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not ready after {timeout} s (log: {log})")


def load_transformers(model_file: Path) -> tuple[Any, str]:
    """The GGUF dequantized to float32 weights by transformers, and the versions used."""
    import torch
    import transformers

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_file.parent, gguf_file=model_file.name, dtype=torch.float32
    ).eval()
    return model, f"transformers {transformers.__version__}, torch {torch.__version__}"


def transformers_run(
    model: Any, prompts: Sequence[list[int]], requests: Sequence[BenchRequest], batch: int
) -> tuple[list[RequestResult], float]:
    """Greedy `generate` over static, left-padded batches of `batch` prompts, every request
    generating exactly its `output_len` tokens. Each step's end is timed, so a request's TTFT is
    its batch's first step (from the batch's start) and its ITLs are the batch's step gaps."""
    results: list[RequestResult] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        results += _generate_batch(model, prompts[i : i + batch], requests[i : i + batch])
    return results, time.perf_counter() - start


def _generate_batch(
    model: Any, prompts: Sequence[list[int]], requests: Sequence[BenchRequest]
) -> list[RequestResult]:
    import torch
    import transformers

    steps: list[float] = []

    class StepTimer(transformers.StoppingCriteria):  # notes each step's end, never stops
        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            steps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    new_tokens = max(r.output_len for r in requests)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            stopping_criteria=transformers.StoppingCriteriaList([StepTimer()]),
        )
    results = []
    for prompt, request in zip(prompts, requests, strict=True):
        times = steps[: request.output_len]
        results.append(
            RequestResult(
                success=True,
                prompt_len=len(prompt),
                output_tokens=len(times),
                ttft=times[0] - start,
                latency=times[-1] - start,
                itl=[b - a for a, b in itertools.pairwise(times)],
                text="",
            )
        )
    return results
