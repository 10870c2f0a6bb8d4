"""LoRA over HTTP and gRPC (#24), in-process over a tiny Llama with peft adapters: a request
picks its adapter by `model` and gets the offline engine's greedy tokens for it; /v1/models
lists adapters with their parent; the runtime load/unload endpoints exist only with their flag,
need the API key, and refuse paths outside the allowed directories (`..` and symlink escapes
included) and bad adapters with a 400 in OpenAI's error shape; the flags parse to a LoRAConfig."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from engine.builder import build_engine
from engine.config import CacheConfig, CompilationConfig, EngineConfig, LoRAConfig, SchedulerConfig
from engine.errors import XlaserveError
from engine.llm_engine import LLMEngine, run_to_completion
from engine.request import SamplingParams
from serving import cli
from serving.async_engine import AsyncEngine
from serving.grpc.server import start_grpc_server
from serving.grpc.stubs import pb2, pb2_grpc
from serving.openai import create_app

KEY = "lora-key"
PROMPT = [256, 72, 105, 32, 116, 104, 101, 114, 101]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def setup(lora) -> Iterator[tuple[LLMEngine, AsyncEngine, Path, object]]:
    """The suite's LoRA engine (tests/conftest.py): `startup` registered at start-up, runtime
    loads allowed from `root/allowed` only."""
    front = AsyncEngine(lora.engine)
    yield lora.engine, front, lora.root, lora.base
    front.shutdown(timeout=5)


def offline(front: AsyncEngine, lora_name: str | None) -> list[int]:
    """The greedy tokens of PROMPT through the engine alone (on its thread, between steps)."""
    engine = front.engine

    def generate() -> list[int]:
        engine.add_request("offline", PROMPT, GREEDY, lora_name=lora_name)
        return run_to_completion(engine, ["offline"])[0].outputs[0].token_ids

    return asyncio.run(front.run(generate))


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app")


def _assert_error(response: httpx.Response, status: int, words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and words in error["message"], error


def cmpl(model: str) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def test_load_endpoints_are_absent_without_their_flag(setup) -> None:
    _, front, root, _ = setup
    app = create_app(front, "tiny", api_key=KEY)

    async def main() -> None:
        async with _client(app) as client:
            body = {"lora_name": "x", "lora_path": str(root / "allowed" / "runtime")}
            _assert_error(
                await client.post("/v1/load_lora_adapter", json=body, headers=HEADERS), 404, ""
            )
            _assert_error(
                await client.post(
                    "/v1/unload_lora_adapter", json={"lora_name": "startup"}, headers=HEADERS
                ),
                404,
                "",
            )

    asyncio.run(main())


def test_adapters_over_http(setup) -> None:
    """Pick by `model`, list with parent, load (key needed, allowed dirs only), serve, unload."""
    engine, front, root, _ = setup
    want = {name: offline(front, name) for name in (None, "startup")}
    assert want[None] != want["startup"]
    app = create_app(front, "tiny", api_key=KEY, allow_lora_updating=True)
    allowed = root / "allowed"
    (allowed / "escape").symlink_to(root / "startup")  # a link out of the allowed directory

    async def main() -> None:
        async with _client(app) as client:
            for model in ("tiny", "startup"):
                got = await client.post("/v1/completions", json=cmpl(model), headers=HEADERS)
                assert got.status_code == 200, got.text
                assert got.json()["model"] == model
                text = got.json()["choices"][0]["text"]
                assert text == engine.tokenizer.decode(want[None if model == "tiny" else "startup"])
            _assert_error(
                await client.post("/v1/completions", json=cmpl("nope"), headers=HEADERS),
                404,
                "nope",
            )
            models = (await client.get("/v1/models", headers=HEADERS)).json()["data"]
            registered = engine.list_loras()
            assert "startup" in registered and "runtime" not in registered
            assert [(m["id"], m.get("parent")) for m in models] == [
                ("tiny", None),
                *((name, "tiny") for name in registered),
            ]

            load = "/v1/load_lora_adapter"
            good = {"lora_name": "runtime", "lora_path": str(allowed / "runtime")}
            _assert_error(await client.post(load, json=good), 401, "API key")
            for path in (root / "startup", allowed / ".." / "startup", allowed / "escape"):
                body = {"lora_name": "bad", "lora_path": str(path)}
                _assert_error(
                    await client.post(load, json=body, headers=HEADERS), 400, "not inside"
                )
            big = {"lora_name": "big", "lora_path": str(allowed / "too-big")}
            _assert_error(
                await client.post(load, json=big, headers=HEADERS), 400, "rank 32 is above"
            )
            missing = {"lora_name": "gone", "lora_path": str(allowed / "missing")}
            _assert_error(
                await client.post(load, json=missing, headers=HEADERS), 400, "cannot read"
            )
            assert (await client.post(load, json=good, headers=HEADERS)).status_code == 200
            _assert_error(
                await client.post(load, json=good, headers=HEADERS), 400, "already in use"
            )
            got = await client.post("/v1/completions", json=cmpl("runtime"), headers=HEADERS)
            assert got.status_code == 200, got.text
            runtime_text = got.json()["choices"][0]["text"]
            ids = [
                m["id"] for m in (await client.get("/v1/models", headers=HEADERS)).json()["data"]
            ]
            assert ids == ["tiny", *registered, "runtime"]
            unload = "/v1/unload_lora_adapter"
            _assert_error(await client.post(unload, json={"lora_name": "runtime"}), 401, "API key")
            assert (
                await client.post(unload, json={"lora_name": "runtime"}, headers=HEADERS)
            ).status_code == 200
            _assert_error(
                await client.post("/v1/completions", json=cmpl("runtime"), headers=HEADERS),
                404,
                "runtime",
            )
            return runtime_text

    runtime_text = asyncio.run(main())
    add = lambda: engine.add_lora("runtime", str(allowed / "runtime"))  # the same files
    asyncio.run(front.run(add))
    assert runtime_text == engine.tokenizer.decode(offline(front, "runtime"))
    asyncio.run(front.run(lambda: engine.remove_lora("runtime")))


def test_grpc_lora_name_picks_the_adapter(setup) -> None:
    _, front, _, _ = setup
    want = offline(front, "startup")
    handle = start_grpc_server(front, 0, "tiny", host="127.0.0.1")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            stub = pb2_grpc.GenerationStub(channel)
            params = pb2.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
            request = pb2.GenerateRequest(
                token_ids=pb2.TokenIds(ids=PROMPT), sampling_params=params, lora_name="startup"
            )
            tokens = [t for m in stub.Generate(request, timeout=120) for t in m.token_ids]
            assert tokens == want
            request.lora_name = "nope"
            with pytest.raises(grpc.RpcError) as error:
                list(stub.Generate(request, timeout=120))
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        handle.stop(grace=1)


def test_lora_flags(tmp_path) -> None:
    args = cli._parser().parse_args(
        ["serve", "--enable-lora", "--lora-modules", "a=/x/a", "b=/x/b", "--max-loras", "2",
         "--max-lora-rank", "8", "--max-cpu-loras", "3", "--allow-runtime-lora-updating",
         "--lora-dirs", "/x", "/y"]
    )  # fmt: skip
    assert cli.serve_config(args).lora == LoRAConfig(
        max_loras=2,
        max_lora_rank=8,
        max_cpu_loras=3,
        modules=(("a", "/x/a"), ("b", "/x/b")),
        allowed_dirs=("/x", "/y"),
        allow_runtime_updating=True,
    )
    assert cli.serve_config(cli._parser().parse_args(["serve"])).lora is None
    for bad in (["--lora-modules", "a=/x"], ["--enable-lora", "--lora-modules", "noequals"],
                ["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"]):  # fmt: skip
        with pytest.raises(XlaserveError):
            cli.serve_config(cli._parser().parse_args(["serve", *bad]))


def test_a_bad_startup_adapter_is_a_one_line_error(lora) -> None:
    """`--lora-modules` with an adapter of too high a rank: build_engine raises the one-line
    XlaserveError that the CLI prints (serving/cli.py main)."""
    config = EngineConfig(
        model=str(lora.directory),
        compilation=CompilationConfig(warm_up="lazy"),
        cache=CacheConfig(page_size=4, num_pages=16),
        scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=32),
        lora=LoRAConfig(modules=(("big", str(lora.root / "allowed" / "too-big")),)),
    )
    with pytest.raises(XlaserveError) as error:
        build_engine(config)
    assert str(error.value) == (
        "adapter 'big': rank 32 is above the maximum LoRA rank 16 (--max-lora-rank)"
    )
