"""The host's own cost per engine step, phase by phase, with a device step that costs almost
nothing (a one-layer model of hidden size 64), at 16 to 1,024 running decode sequences.

    python bench/host_overhead.py --write-results

On a TPU or an H200 a decode step of a small model takes a few milliseconds; whatever the host
spends around it (scheduling, building the batch, moving it to the device, reading the sampled
tokens back, stop checks and detokenization) is then what limits throughput. The phases:

- schedule: `Scheduler.schedule` (admission, pages, preemption);
- build: the step's NumPy inputs (`BatchBuilder.build`);
- launch: moving them to the device and dispatching the compiled parts (`run_batch`);
- bookkeeping: what runs while the device computes (`Scheduler.update_after_step`);
- wait: `fetch`, blocked until the sampled tokens are on the host (device time not hidden);
- postprocess: tokens appended, stop checks, detokenized deltas (`LLMEngine._postprocess`).

The host's critical path per step is every phase but `wait`. The phases are timed by wrapping
the engine's own methods on this one instance; nothing in the engine changes.

Then the same model behind `xlaserve serve` with as many streaming clients as sequences: the
engine's steps per second there (generated tokens per second over the running count, from
/metrics, once every client's second request streams) against its offline rate on the same
requests: an engine configured as the server's, the same clients' requests stepped in this
process with no server (the rows of (a) are not that work: their contexts are shorter and all
of one length, and the CPU attention's cost follows the longest). The two alternate,
`--repeats` windows of each, `--window` seconds long, the server kept up (and idle while the
offline engine steps): this VM's speed drifts by more than the ratio's target between runs
minutes apart, so the table gives the median of the pairs' ratios and their range. The
clients run in this process on the same two cores, as a load generator beside a server does;
each streams a completion to its end and starts the next (their first requests of staggered
lengths, so that requests end spread over the steps), and by default reads every byte of
every stream over a bare asyncio connection without parsing it (`--load-generator raw`):
httpx parsing every SSE line (`--load-generator httpx`) takes a large share of the two cores
from the server and the engine core, which a client on another machine would not. Beside the
rates, each process's CPU in the window (from /proc: this process, the API server(s), the
engine core) and the CPU milliseconds per step of the engine offline, of the engine core and
of the API server served; the rates depend on what else runs on the machine, the CPU per step
much less. For a profile of the served engine core, set XLASERVE_PROFILE_CORE
(serving/engine_core.py). Each served row runs with every `--stream-interval` given (default
1, each token sent as it comes, and 8, SGLang's option of sending a stream's tokens in chunks
after its first), offline configured the same. With `--cores isolated` as well, the served
rows run again with the engine core process on a core of its own and the API server and the
load generator on the other, and the offline engine on that one core too: the process
boundary's own cost, without the two cores' contention (a server host has cores to spare
beside its accelerator; this VM has two). Last, (a)'s phases in those offline runs, where
requests end and join nearly every step, as behind a server.

(c) The sizes above with asynchronous scheduling off and on, side by side: steps per second,
and the asynchronous loop's own phases (its `wait` is what the device step did not hide).
Here the "device" is XLA:CPU on the same two cores as the host: with asynchronous scheduling
its compute runs beside the host's Python and takes a core from it (a TPU or GPU would not), so
the asynchronous loop's phases take longer in wall time than the synchronous ones for the same
work (their CPU time differs little), and (c) understates what the overlap gives beside an
accelerator. XLA_FLAGS such as --xla_cpu_multi_thread_eigen=false do not confine XLA:CPU's
thread pool in this jax, so (c) runs a second time with thread affinities instead: the host
loop's thread on the first core, every other thread of the process (XLA:CPU's) on the rest.
The device step then has one core (slower than on two), but it no longer takes the host's:
the shape of a host beside an accelerator.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import uvloop

from bench import baselines, common
from engine import compilation
from engine.builder import build_engine
from engine.config import CacheConfig, CompilationConfig, EngineConfig, SchedulerConfig
from engine.host_gc import configure_collector
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams

TITLE = "Host overhead per step (bench/host_overhead.py)"
PHASES = ("schedule", "build", "launch", "bookkeeping", "wait", "postprocess")
HOST_PHASES = tuple(p for p in PHASES if p != "wait")
PROMPT_LEN = 8
MODEL_LEN = 256
PINNED_HEADING = (
    "(c) again with the device on its own core: the host loop's thread pinned to one core, "
    "XLA:CPU's threads to the other"
)
CHURN_HEADING = (
    "(a) again in the offline runs of the served rows' work (asynchronous scheduling on): "
    "requests end and join nearly every step"
)
MODEL_DIMS = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
}


class PhaseClock:
    """Seconds spent in each wrapped method, summed until `reset`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, owner: Any, method: str, phase: str) -> None:
        inner: Callable[..., Any] = getattr(owner, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start

        setattr(owner, method, timed)

    def reset(self) -> None:
        self.seconds.clear()


def instrument(engine: LLMEngine) -> PhaseClock:
    clock = PhaseClock()
    clock.wrap(engine.scheduler, "schedule", "schedule")
    clock.wrap(engine.runner.builder, "build", "build")
    clock.wrap(engine.runner, "run_batch", "launch")
    clock.wrap(engine.scheduler, "update_after_step", "bookkeeping")
    clock.wrap(engine.runner, "fetch", "wait")
    clock.wrap(engine, "_postprocess", "postprocess")
    return clock


def write_checkpoint() -> Path:
    """A random one-layer Llama with the tests' byte-level tokenizer, whose output layer is zero
    for every id past ASCII: greedy picks ASCII bytes, text whose every token is a whole piece,
    as a real model's tokens nearly all are. (Random bytes would be half UTF-8 fragments, which
    detokenization must decode in a window: a cost real text seldom has.)"""
    from safetensors.numpy import load_file, save_file

    from tests.engine.tiny_model import write_tiny_checkpoint

    directory = write_tiny_checkpoint(Path(tempfile.mkdtemp()), **MODEL_DIMS)
    weights = load_file(directory / "model.safetensors")
    weights["lm_head.weight"][128:] = 0.0
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


@contextlib.contextmanager
def device_on_its_own_core() -> Iterator[bool]:
    """Pins this thread (the engine's host loop) to the first core and every other thread of
    the process (XLA:CPU's) to the others, as an accelerator computes beside its host rather
    than on the host's cores; yields False (and pins nothing) on a machine of one core."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        yield False
        return
    me = threading.get_native_id()
    threads = [int(t) for t in os.listdir("/proc/self/task")]
    for tid in threads:
        os.sched_setaffinity(tid, cores[:1] if tid == me else cores[1:])
    try:
        yield True
    finally:
        _pin(os.getpid(), cores)


def measure(
    engine: LLMEngine,
    clock: PhaseClock,
    running: int,
    steps: int,
    warm_steps: int,
    *,
    async_scheduling: bool = False,
) -> dict[str, float]:
    """Milliseconds per decode step in each phase, and the whole step, with `running`
    sequences decoding, every one of them through every timed step. Prefill and the first
    `warm_steps` decode steps (which may compile a bucket) are not timed.

    The prompts are admitted over tens of steps (each step's token budget goes to the running
    decodes first), so the first sequences are that many tokens ahead when the last one joins:
    each may run to the model's length, and the timed windows end before any does."""
    engine.async_scheduling = async_scheduling
    # Timed windows in which something compiled (a bucket's first use) are redone, up to 3.
    tries = max(1, min(3, (MODEL_LEN // 2) // steps))
    max_tokens = MODEL_LEN - PROMPT_LEN - 1
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    vocab = engine.model_info().vocab_size
    for i in range(running):
        prompt = [(i * 7 + j * 13) % (vocab - 8) + 4 for j in range(PROMPT_LEN)]
        engine.add_request(f"r{running}-{async_scheduling}-{i}", prompt, params)
    prefilled = engine.stats().num_computed_prompt_tokens + running * PROMPT_LEN
    while engine.stats().num_computed_prompt_tokens < prefilled:  # the counter spans sizes
        engine.step()
    for _ in range(warm_steps):
        engine.step()
    for _ in range(tries):
        clock.reset()
        compiled, start, cpu = compilation.count(), time.perf_counter(), time.process_time()
        for _ in range(steps):
            engine.step()
        total, cpu = time.perf_counter() - start, time.process_time() - cpu
        if engine.scheduler.num_running != running:
            raise RuntimeError(f"{engine.scheduler.num_running} of {running} ran to the end")
        if compilation.count() == compiled:
            break
    per_step = {phase: clock.seconds[phase] * 1e3 / steps for phase in PHASES}
    per_step["host"] = sum(per_step[p] for p in HOST_PHASES)
    per_step["step"] = total * 1e3 / steps
    per_step["cpu"] = cpu * 1e3 / steps  # the process's CPU (every thread's) per step
    for i in range(running):
        engine.abort_request(f"r{running}-{async_scheduling}-{i}")
    while engine.has_unfinished_requests():
        engine.step()
    return per_step


class ClosedLoop:
    """The served runs' work without the server: an engine configured as `xlaserve serve` is
    in `served_and_offline` (asynchronous scheduling on, as served), `running` clients'
    requests (the same prompts and lengths, each client's next request added as soon as its
    last ends) stepped in this process. The decode rows of (a) are not this work: their
    contexts are shorter and all of one length (the CPU attention's cost follows the
    longest), and no request ends or joins. The loop pauses between windows, its requests
    kept: each window continues the steady state the last one left."""

    def __init__(self, model_dir: Path, running: int, stream_interval: int = 1) -> None:
        engine = build_engine(
            EngineConfig(
                str(model_dir),
                scheduler=SchedulerConfig(
                    max_num_seqs=running,
                    max_num_batched_tokens=max(running, 32),
                    max_model_len=MODEL_LEN,
                    stream_interval=stream_interval,
                ),
                compilation=CompilationConfig(warm_up="lazy"),
            )
        )
        assert isinstance(engine, LLMEngine)
        configure_collector()
        self.engine, self.clock, self.running = engine, instrument(engine), running
        self._request_ids = itertools.count()
        self._client_of: dict[str, int] = {}  # request id -> the client that sent it
        for i in range(running):
            self._add(i, first=True)
        self._step(STREAM_TOKENS // 2)  # into the steady state: requests end and start every step

    def _add(self, i: int, first: bool) -> None:
        body = _stream_body(i, self.running, first)
        params = SamplingParams(temperature=0, max_tokens=body["max_tokens"], ignore_eos=True)
        request_id = str(next(self._request_ids))
        self._client_of[request_id] = i
        self.engine.add_request(request_id, self.engine.tokenizer.encode(body["prompt"]), params)

    def _step(self, num_steps: int) -> int:
        """Tokens generated in `num_steps` steps."""
        generated = 0
        for _ in range(num_steps):
            for output in self.engine.step():
                generated += len(output.outputs[0].token_ids)
                if output.finished:
                    self._add(self._client_of.pop(output.request_id), first=False)
        return generated

    def window(
        self, seconds: float, cores: str = "shared"
    ) -> tuple[float, float, dict[str, float]]:
        """Steps for `seconds` (again while a step compiled: a bucket's first use): engine
        steps per second as the served rows count them (generated tokens over the running
        count), the process's CPU milliseconds per step, and the milliseconds per step of
        each host phase (as in (a)). `cores`: as `--cores` says."""
        with contextlib.ExitStack() as placement:
            if cores == "isolated":
                placement.enter_context(engine_on_its_own_core(served=False))
            while True:
                self.clock.reset()
                compiled, start, cpu = compilation.count(), time.perf_counter(), time.process_time()
                generated = steps = 0
                while steps == 0 or time.perf_counter() - start < seconds:
                    generated += self._step(1)
                    steps += 1
                elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
                if compilation.count() == compiled:
                    break
        rate = generated / self.running / elapsed
        phases = {phase: self.clock.seconds[phase] * 1e3 / steps for phase in PHASES}
        phases["host"] = sum(phases[p] for p in HOST_PHASES)
        phases["step"] = elapsed * 1e3 / steps
        return rate, cpu * 1e3 / (rate * elapsed), phases

    def close(self) -> None:
        self.engine.close()


ENGINE_PLACES = {  # --served-engine: where the served engine runs, and the server's processes
    "core": [],
    "in-process": ["--engine-in-process"],
    "core-2-api": ["--api-server-count", "2"],
}


# One served window's measure: engine steps per second, and each process's share of a core.
Served = tuple[float, dict[str, float]]
Offline = tuple[float, float, dict[str, float]]  # ClosedLoop.window's


def served_and_offline(
    loop: ClosedLoop,
    model_dir: Path,
    port: int,
    window: float,
    log_dir: Path,
    place: str = "core",
    load_generator: str = "raw",
    stream_interval: int = 1,
    cores: str = "shared",
    repeats: int = 3,
) -> list[tuple[Offline, Served]]:
    """Offline windows of `loop` and served ones alternating, `repeats` of each, as pairs:
    engine steps per second behind the HTTP server while `loop.running` clients stream, with
    the engine in its own process (`core`) or on a thread of the server's (`in-process`), and
    the share of one core each process used in the window (`cpu_shares`). The server stays
    up throughout, idle (no request running) in the offline windows, so that each pair ran
    minutes apart at most: this VM's speed drifts by more than the ratio's target between
    runs of the same tree, and a ratio of a pair keeps little of that."""
    command = [
        sys.executable, "-m", "serving.cli", "serve", "--model", str(model_dir),
        "--served-model-name", "bench", "--port", str(port),
        "--max-num-seqs", str(loop.running), "--max-num-batched-tokens",
        str(max(loop.running, 32)), "--max-model-len", str(MODEL_LEN), "--warm-up", "eager",
        "--max-queued-requests", str(loop.running),
        "--compilation-cache-dir", str(baselines.CACHE / "xla-host-overhead"),
        "--stream-interval", str(stream_interval), *ENGINE_PLACES[place],
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    log = log_dir / f"host-overhead-serve-{place}-{loop.running}-{stream_interval}-{cores}.log"
    pairs = []
    with baselines.server_process(command, url + "/health", log, timeout=1800):
        for _ in range(repeats):
            offline = loop.window(window, cores)
            with contextlib.ExitStack() as placement:
                if cores == "isolated":
                    placement.enter_context(engine_on_its_own_core(served=True))
                with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                    sampled = _stream_and_sample(url, loop.running, window, load_generator)
                    served = runner.run(sampled)
            pairs.append((offline, served))
    return pairs


async def _stream_and_sample(
    url: str, running: int, window: float, load_generator: str
) -> tuple[float, dict[str, float]]:
    limits = httpx.Limits(max_connections=running + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        steady: set[int] = set()  # the clients whose second request has begun
        streams = [
            asyncio.create_task(
                _stream_raw(url, i, running, steady)
                if load_generator == "raw"
                else _stream_httpx(client, i, running, steady)
            )
            for i in range(running)
        ]
        try:
            while len(steady) < running:
                failed = [t for t in streams if t.done()]
                if failed:
                    failed[0].result()  # raises what ended it
                await asyncio.sleep(0.2)
            while True:  # a window in which nothing compiled (a bucket's first use may)
                compiled = await _metric(client, "compilations_total")
                first, start = await _metric(client, "generation_tokens_total"), time.perf_counter()
                cpu_before = cpu_seconds()
                await asyncio.sleep(window)
                cpu_after = cpu_seconds()
                last, end = await _metric(client, "generation_tokens_total"), time.perf_counter()
                if await _metric(client, "compilations_total") == compiled:
                    break
            failed = [t for t in streams if t.done()]
            if failed:
                failed[0].result()
        finally:
            for task in streams:
                task.cancel()  # disconnects: the server aborts them
            await asyncio.gather(*streams, return_exceptions=True)
        deadline = time.monotonic() + 60
        while await _metric(client, "num_requests_running") > 0:  # idle before what comes next
            if time.monotonic() > deadline:
                raise RuntimeError(
                    "the server still runs requests a minute after every client left"
                )
            await asyncio.sleep(0.1)
    shares = cpu_shares(cpu_before, cpu_after, end - start)
    return (last - first) / running / (end - start), shares


def cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) so far of this process and of its descendants, by role:
    `bench` (this process: the load generator), `core` (the engine core process, named
    xlaserve-core), `api` (the other descendants: the API server processes)."""
    totals: dict[str, float] = defaultdict(float)
    for role, seconds in _processes().values():
        totals[role] += seconds
    return totals


def _processes() -> dict[int, tuple[str, float]]:
    """This process and its descendants: pid -> (role, as `cpu_seconds` names them; CPU
    seconds so far)."""
    me = os.getpid()
    parents: dict[int, int] = {}
    times: dict[int, tuple[str, float]] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # gone meanwhile
            continue
        name, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :]
        fields = rest.split()  # from the state (field 3) on
        pid = int(text.split(" ", 1)[0])
        parents[pid] = int(fields[1])
        times[pid] = (name, (int(fields[11]) + int(fields[12])) / tick)
    roles: dict[int, tuple[str, float]] = {}
    for pid, (name, seconds) in times.items():
        ancestor = pid
        while ancestor not in (me, 0, 1) and ancestor in parents:
            ancestor = parents[ancestor]
        if pid == me:
            roles[pid] = ("bench", seconds)
        elif ancestor == me:
            roles[pid] = ("core" if name.startswith("xlaserve-core") else "api", seconds)
    return roles


def _pin(pid: int, cores: Sequence[int]) -> None:
    """Every thread of process `pid` (those it starts later inherit it) on `cores`."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread may have ended
            os.sched_setaffinity(int(task.name), cores)


@contextlib.contextmanager
def engine_on_its_own_core(served: bool) -> Iterator[bool]:
    """`--cores isolated`: the engine (offline: this whole process; served: the engine core
    process) on the last core, everything else (the load generator, the API server) on the
    others, as on a host with cores to spare for its server; yields False (and pins nothing)
    on a machine of one core. Restores this process's affinity on exit."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        yield False
        return
    engine, rest = cores[-1:], cores[:-1]
    if served:
        for pid, (role, _) in _processes().items():
            _pin(pid, engine if role == "core" else rest)
    else:
        _pin(os.getpid(), engine)
    try:
        yield True
    finally:
        _pin(os.getpid(), cores)


def cpu_shares(
    before: dict[str, float], after: dict[str, float], seconds: float
) -> dict[str, float]:
    """Each role's CPU seconds in the window over its wall seconds (1.0: one core busy)."""
    return {role: (after[role] - before.get(role, 0.0)) / seconds for role in sorted(after)}


STREAM_TOKENS = 200  # each client's requests, within MODEL_LEN with their prompts


def _stream_body(i: int, running: int, first: bool) -> dict[str, Any]:
    """Client `i`'s request; its first is shorter, by i / running of the others', so that the
    clients' requests end (and the next ones arrive) spread over the steps, not all at once."""
    tokens = max(1, STREAM_TOKENS * i // running) if first else STREAM_TOKENS
    return {
        "model": "bench", "prompt": f"stream {i}", "max_tokens": tokens, "ignore_eos": True,
        "temperature": 0, "stream": True,
    }  # fmt: skip


async def _stream_httpx(client: httpx.AsyncClient, i: int, running: int, steady: set[int]) -> None:
    """One client (httpx, parsing every SSE line): a streamed completion read to its end, then
    the next, until cancelled (so that as many sequences run through the whole window). It
    joins `steady` once its second request, the first of the full length, is answered."""
    for k in itertools.count():
        body = _stream_body(i, running, first=k == 0)
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread())[:300]
                raise RuntimeError(f"HTTP {response.status_code}: {text!r}")
            if k == 1:
                steady.add(i)
            async for _ in response.aiter_lines():
                pass


async def _stream_raw(url: str, i: int, running: int, steady: set[int]) -> None:
    """As `_stream_httpx`, over a bare connection kept alive from request to request (as an
    OpenAI client's connection pool does): every byte of every response is received, its status
    checked and its end (`data: [DONE]`, then the chunked body's last chunk) found, but nothing
    is parsed, and the bytes are taken in `_RawResponses.data_received`, a call from the event
    loop (uvloop's, in C) per arriving segment rather than a coroutine resumed per read, so that
    the load generator, on the same two cores, takes as little from the server as a client on
    another machine would."""
    host, port = url.removeprefix("http://").split(":")
    loop = asyncio.get_running_loop()
    transport, responses = await loop.create_connection(_RawResponses, host, int(port))
    try:
        for k in itertools.count():
            body = json.dumps(_stream_body(i, running, first=k == 0)).encode()
            head = (
                f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode()
            answered = responses.expect()
            transport.write(head + body)
            await answered
            if k == 1:
                steady.add(i)
    finally:
        transport.close()


class _RawResponses(asyncio.Protocol):
    """One connection's responses, one at a time: `expect()` before each request gives a
    future that is done once the response's last bytes arrived (or fails on a status other than
    200, or on the connection's end)."""

    def __init__(self) -> None:
        self._answered: asyncio.Future[None] | None = None
        self._head = b""  # the response's first bytes, until its status line is whole
        self._tail = b""  # its last bytes, where its end shows

    def expect(self) -> asyncio.Future[None]:
        self._answered = asyncio.get_running_loop().create_future()
        self._head, self._tail = b"", b""
        return self._answered

    def data_received(self, data: bytes) -> None:
        answered = self._answered
        if answered is None or answered.done():
            return
        if b"\r\n" not in self._head:
            self._head += data[:64]
            if b"\r\n" in self._head and not self._head.startswith(b"HTTP/1.1 200"):
                answered.set_exception(RuntimeError(f"{self._head!r}: {data[:300]!r}"))
                return
        self._tail = (self._tail + data[-64:])[-64:]
        if self._tail.endswith(_STREAM_END):
            answered.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._answered is not None and not self._answered.done():
            error = RuntimeError(f"the connection ended mid-response: {self._tail!r}")
            self._answered.set_exception(error)


_STREAM_END = b"data: [DONE]\n\n\r\n0\r\n\r\n"  # the last event, then the last chunk


async def _metric(client: httpx.AsyncClient, name: str) -> float:
    text = (await client.get("/metrics")).text
    found = re.search(rf"^xlaserve:{name}{{[^}}]*}} ([0-9.e+]+)$", text, re.MULTILINE)
    if found is None:
        raise RuntimeError(f"/metrics has no xlaserve:{name}")
    return float(found.group(1))


def table(rows: dict[Any, dict[str, float]], label: str = "running seqs") -> list[str]:
    """Milliseconds per step in each phase, one row per key of `rows` (its cells, ` | `
    between them, under `label`'s)."""
    header = f"| {label} | " + " | ".join(PHASES) + " | host critical path | whole step |"
    lines = [header, "|" + "---|" * (len(PHASES) + 3 + label.count("|"))]
    for running, ms in rows.items():
        cells = " | ".join(f"{ms[p]:.2f}" for p in PHASES)
        lines.append(f"| {running} | {cells} | {ms['host']:.2f} | {ms['step']:.2f} |")
    return lines


def served_table(
    comparisons: dict[tuple[str, int, int, str], list[tuple[Offline, Served]]],
) -> list[str]:
    """The served rate against the offline one on the same requests, per (engine place,
    running, stream interval, cores) of `comparisons` (`served_and_offline`'s pairs): the
    median rate of each, and the median (lowest-highest) of the pairs' ratios; how busy each
    process was in the served windows (cores: CPU seconds per second of the load generator,
    the API server(s) and the engine core); and the CPU milliseconds per engine step of the
    engine's process offline, of the engine core served and of the API server(s), which,
    unlike the rates, do not depend much on what else the machine runs (means over the
    windows)."""
    lines = [
        "| streaming clients | stream interval | cores | engine | offline steps/s "
        "| served steps/s | served / offline: median (range) | cores: load generator "
        "| API server | engine core | CPU ms/step: offline | engine core | API server |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    targets = []
    for (place, running, interval, placing), pairs in comparisons.items():
        offline = statistics.median(o[0] for o, _ in pairs)
        served = statistics.median(s[0] for _, s in pairs)
        ratios = sorted(s[0] / o[0] for o, s in pairs)
        ratio = f"{statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})"
        cores = " | ".join(
            f"{statistics.mean(s[1].get(role, 0.0) for _, s in pairs):.2f}"
            for role in ("bench", "api", "core")
        )
        per_step = " | ".join(
            f"{statistics.mean(s[1].get(role, 0.0) * 1e3 / s[0] for _, s in pairs):.2f}"
            for role in ("core", "api")
        )
        offline_cpu = statistics.mean(o[1] for o, _ in pairs)
        lines.append(
            f"| {running} | {interval} | {placing} | {place} | {offline:.1f} | {served:.1f} "
            f"| {ratio} | {cores} | {offline_cpu:.2f} | {per_step} |"
        )
        if running == 256:
            met = "met" if statistics.median(ratios) >= 0.8 else "NOT met"
            targets.append(
                f"- served / offline at 256 streaming clients, engine {place}, stream interval "
                f"{interval}, cores {placing}: {ratio} over {len(pairs)} pairs of windows "
                f"(target 0.8: {met})"
            )
    return [*lines, *([""] if targets else []), *targets]


def async_table(
    sync: dict[int, dict[str, float]], asynchronous: dict[int, dict[str, float]]
) -> list[str]:
    """(c): steps per second with asynchronous scheduling off and on, and the async phases."""
    header = (
        "| running seqs | sync steps/s | async steps/s | async / sync | "
        + " | ".join(f"async {p}" for p in PHASES)
        + " | async host critical path |"
    )
    lines = [header, "|" + "---|" * (len(PHASES) + 5)]
    for running, ms in asynchronous.items():
        off, on = 1e3 / sync[running]["step"], 1e3 / ms["step"]
        cells = " | ".join(f"{ms[p]:.2f}" for p in PHASES)
        lines.append(
            f"| {running} | {off:.1f} | {on:.1f} | {on / off:.2f} | {cells} | {ms['host']:.2f} |"
        )
    return lines


def _target_line(
    rows: dict[int, dict[str, float]],
    asynchronous: dict[int, dict[str, float]],
    pinned: dict[bool, dict[int, dict[str, float]]],
) -> list[str]:
    if 256 not in rows:
        return []
    host = rows[256]["host"]
    met = "met" if host <= 2.0 else "NOT met"
    lines = [f"- host critical path at 256 running sequences: {host:.2f} ms per step (target at "
             f"most 2 ms: {met})"]  # fmt: skip
    if 256 in asynchronous:
        ratio = rows[256]["step"] / asynchronous[256]["step"]
        met = "met" if ratio >= 1.3 else "NOT met"
        lines.append(f"- async / sync steps per second at 256: {ratio:.2f}x (target 1.3x: {met})")
    if pinned and 256 in pinned[True]:
        ratio = pinned[False][256]["step"] / pinned[True][256]["step"]
        met = "met" if ratio >= 1.3 else "NOT met"
        lines.append(
            f"- async / sync steps per second at 256, device on its own core: {ratio:.2f}x "
            f"(target 1.3x: {met})"
        )
    return lines


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--running", type=int, nargs="+", default=[16, 64, 256, 1024])
    p.add_argument("--steps", type=int, default=100, help="timed decode steps per size")
    p.add_argument("--warm-steps", type=int, default=3)
    p.add_argument(
        "--served",
        type=int,
        nargs="*",
        default=[16, 64, 256],
        help="running sizes to measure behind the server too (none: skip)",
    )
    p.add_argument(
        "--window",
        type=float,
        default=5.0,
        help="seconds of each window, offline and behind the server",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="offline and served windows alternating, this many of each, per served row",
    )
    p.add_argument(
        "--served-engine",
        nargs="+",
        choices=tuple(ENGINE_PLACES),
        default=["core", "in-process"],
        help="where the served engine runs: its own process (core, the default of xlaserve "
        "serve; core-2-api: behind two API server processes) or a thread of the server's "
        "(in-process); each is measured, side by side",
    )
    p.add_argument(
        "--stream-interval",
        type=int,
        nargs="+",
        default=[1, 8],
        help="the served rows with each of these `xlaserve serve --stream-interval` values (a "
        "stream's tokens sent k at a time after its first), offline configured the same",
    )
    p.add_argument(
        "--cores",
        nargs="+",
        choices=["shared", "isolated"],
        default=["shared"],
        help="the served rows (and their offline rates) with every process on every core "
        "(shared), or the engine on a core of its own and the API server and load generator "
        "on the other (isolated: a server host's spare cores; the offline engine gets the same "
        "one core)",
    )
    p.add_argument(
        "--async-scheduling",
        choices=["both", "on", "off"],
        default="both",
        help="(c): measure with asynchronous scheduling on and off (both), or one of them only",
    )
    p.add_argument(
        "--load-generator",
        choices=["raw", "httpx"],
        default="raw",
        help="the streaming clients: bare asyncio connections reading every byte (raw) or "
        "httpx parsing every SSE line (httpx, several times the CPU on the same two cores)",
    )
    p.add_argument("--port", type=int, default=8751)
    p.add_argument("--write-results", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    most = max(args.running)
    if not set(args.served) <= set(args.running):
        raise SystemExit("--served sizes must be among --running")
    model_dir = write_checkpoint()
    engine = build_engine(
        EngineConfig(
            str(model_dir),
            cache=CacheConfig(num_pages=most * -(-MODEL_LEN // 16) + 64),  # none preempted
            scheduler=SchedulerConfig(
                max_num_seqs=most, max_num_batched_tokens=max(most, 256), max_model_len=MODEL_LEN
            ),
            compilation=CompilationConfig(warm_up="lazy"),
        )
    )
    assert isinstance(engine, LLMEngine)
    configure_collector()  # as `xlaserve serve` does once its engine is built
    clock = instrument(engine)
    modes = {"both": (False, True), "on": (True,), "off": (False,)}[args.async_scheduling]
    measured = {
        mode: {
            n: measure(engine, clock, n, args.steps, args.warm_steps, async_scheduling=mode)
            for n in args.running
        }
        for mode in modes
    }
    rows = measured.get(False) or measured[True]
    asynchronous = measured.get(True, {}) if False in measured else {}
    pinned: dict[bool, dict[int, dict[str, float]]] = {}
    if asynchronous:
        with device_on_its_own_core() as pinning:
            if pinning:
                pinned = {
                    mode: {
                        n: measure(
                            engine, clock, n, args.steps, args.warm_steps, async_scheduling=mode
                        )
                        for n in args.running
                    }
                    for mode in (False, True)
                }
    engine.close()
    comparisons: dict[tuple[str, int, int, str], list[tuple[Offline, Served]]] = {}
    for n in args.served:
        for k in args.stream_interval:
            loop = ClosedLoop(model_dir, n, k)
            for c in args.cores:
                for place in args.served_engine:
                    comparisons[place, n, k, c] = served_and_offline(
                        loop, model_dir, args.port, args.window, model_dir, place,
                        args.load_generator, k, c, args.repeats,
                    )  # fmt: skip
            loop.close()
    offline_windows: dict[str, list[dict[str, float]]] = defaultdict(list)  # every place's
    for (_, n, k, c), pairs in comparisons.items():
        offline_windows[f"{n} | {k} | {c}"] += [phases for (_, _, phases), _ in pairs]
    churn = {  # (a)'s phases, the mean of the offline windows
        key: {p: statistics.mean(w[p] for w in windows) for p in windows[0]}
        for key, windows in offline_windows.items()
    }
    command = "python bench/host_overhead.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = "\n".join(
        [
            *common.preamble(command, {"jax": version("jax")}),
            f"- model: random Llama, {MODEL_DIMS}, float32, byte tokenizer, output layer zero "
            f"past ASCII (whole-piece tokens, as real text); {PROMPT_LEN}-token prompts, "
            f"greedy, EOS ignored; {args.steps} timed decode steps per size; milliseconds per "
            f"step; (a) with asynchronous scheduling {'on' if False not in measured else 'off'}",
            "",
            *table(rows),
            *(["", "(c) asynchronous scheduling off vs on", ""] if asynchronous else []),
            *(async_table(rows, asynchronous) if asynchronous else []),
            *(["", PINNED_HEADING, ""] if pinned else []),
            *(async_table(pinned[False], pinned[True]) if pinned else []),
            "",
            *_target_line(rows, asynchronous, pinned),
            *(["", *served_table(comparisons)] if comparisons else []),
            *(["", CHURN_HEADING, ""] if churn else []),
            *(table(churn, "streaming clients | stream interval | cores") if churn else []),
        ]
    )
    print(text)
    if args.write_results:
        common.write_section(TITLE, text)


if __name__ == "__main__":
    main()
