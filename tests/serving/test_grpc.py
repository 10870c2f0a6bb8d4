"""The gRPC service over the tiny engine, through a real server on 127.0.0.1 and the generated
client stubs: streams equal offline generation, a cancel frees the pages, health, reflection,
INVALID_ARGUMENT for bad input, tokenize/detokenize and the model info."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from engine.llm_engine import LLMEngine, run_to_completion
from engine.request import CompletionOutput, RequestOutput, SamplingParams, Usage
from engine.structured.spec import StructuredOutputs
from serving.async_engine import AsyncEngine
from serving.grpc.convert import stream_messages
from serving.grpc.server import GrpcServerHandle, start_grpc_server
from serving.grpc.stubs import SERVICE_NAME, pb2, pb2_grpc

MODEL = "tiny-llama"
PROMPT = "The quick brown fox"
TIMEOUT = 120  # seconds for a call; the first with logprobs compiles a step variant
Status = health_pb2.HealthCheckResponse


@pytest.fixture
def front(engine: LLMEngine) -> Iterator[AsyncEngine]:
    front = AsyncEngine(engine)
    yield front
    front.shutdown(timeout=5)
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_pages == engine.kv_cache.num_pages


@pytest.fixture
def server(front: AsyncEngine, tiny) -> Iterator[GrpcServerHandle]:
    handle = start_grpc_server(front, 0, MODEL, host="127.0.0.1")
    yield handle
    handle.stop(grace=1)


@pytest.fixture
def channel(server: GrpcServerHandle) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield channel


@pytest.fixture
def stub(channel: grpc.Channel) -> pb2_grpc.GenerationStub:
    return pb2_grpc.GenerationStub(channel)


@dataclass
class Streamed:
    """One Generate call's messages, joined per sequence."""

    token_ids: dict[int, list[int]] = field(default_factory=dict)
    text: dict[int, str] = field(default_factory=dict)
    finish: dict[int, int] = field(default_factory=dict)
    messages: list[pb2.GenerateResponse] = field(default_factory=list)


def generate(stub: pb2_grpc.GenerationStub, request: pb2.GenerateRequest) -> Streamed:
    result = Streamed()
    for message in stub.Generate(request, timeout=TIMEOUT):
        assert message.index not in result.finish, "a message after the sequence finished"
        result.token_ids.setdefault(message.index, []).extend(message.token_ids)
        result.text[message.index] = result.text.get(message.index, "") + message.text
        if message.finish_reason:
            result.finish[message.index] = message.finish_reason
        result.messages.append(message)
    return result


def offline(engine: LLMEngine, prompt: str, params: SamplingParams) -> RequestOutput:
    """The oracle: the same request run to completion by the engine itself (no server)."""
    engine.add_request("offline", prompt, params)
    return run_to_completion(engine, ["offline"])[0]


def test_stream_equals_offline_greedy_generation(engine, front, stub) -> None:
    sampling = pb2.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    streamed = generate(stub, pb2.GenerateRequest(text=PROMPT, sampling_params=sampling))
    front.shutdown(timeout=5)  # the oracle drives the engine itself
    expected = offline(
        engine, PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    )

    assert len(streamed.messages) > 1, "the tokens should arrive over several messages"
    assert streamed.token_ids == {0: expected.outputs[0].token_ids}
    assert streamed.text == {0: expected.outputs[0].text}
    assert streamed.finish == {0: pb2.FINISH_REASON_LENGTH}
    usage = streamed.messages[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(expected.prompt_token_ids), 24)
    assert not any(m.HasField("usage") for m in streamed.messages[:-1])


def test_seeded_n2_with_logprobs_equals_offline(engine, front, stub) -> None:
    params = SamplingParams(
        n=2, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True, logprobs=3
    )
    sampling = pb2.SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    sampling.logprobs = 3
    streamed = generate(stub, pb2.GenerateRequest(text=PROMPT, sampling_params=sampling))
    front.shutdown(timeout=5)
    expected = offline(engine, PROMPT, params)

    assert streamed.token_ids == {o.index: o.token_ids for o in expected.outputs}
    assert streamed.finish == {0: pb2.FINISH_REASON_LENGTH, 1: pb2.FINISH_REASON_LENGTH}
    assert streamed.messages[-1].usage.completion_tokens == 20
    for message in streamed.messages:
        assert [lp.token_id for lp in message.logprobs] == list(message.token_ids)
        for lp in message.logprobs:
            tops = [t.logprob for t in lp.top_logprobs]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True) and lp.logprob <= 0


def test_stop_string_text_is_never_taken_back(engine, front, stub) -> None:
    """Text that a later stop string cuts must never have been streamed."""
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = generate(stub, pb2.GenerateRequest(text=PROMPT, sampling_params=_proto(greedy)))
    stop = _clean_slice(plain.text[0], start=4, length=3)
    streamed = generate(
        stub, pb2.GenerateRequest(text=PROMPT, sampling_params=_proto(greedy, stop=[stop]))
    )
    front.shutdown(timeout=5)
    expected = offline(engine, PROMPT, greedy.replace(stop=(stop,)))

    assert streamed.text == {0: expected.outputs[0].text}
    assert streamed.text == {0: plain.text[0][: plain.text[0].index(stop)]}
    assert streamed.finish == {0: pb2.FINISH_REASON_STOP}
    assert streamed.messages[-1].stop_reason.stop_string == stop


def _clean_slice(text: str, start: int, length: int) -> str:
    """The first `length` characters from `start` on without U+FFFD (a partial UTF-8 byte that
    later bytes may complete, so not a stable stop string)."""
    for i in range(start, len(text) - length):
        if "\ufffd" not in text[i : i + length]:
            return text[i : i + length]
    raise AssertionError(f"no clean slice of {text!r}")


def _proto(params: SamplingParams, stop: list[str] | None = None) -> pb2.SamplingParams:
    return pb2.SamplingParams(
        temperature=params.temperature,
        max_tokens=params.max_tokens,
        ignore_eos=params.ignore_eos,
        stop=stop or [],
    )


def test_cancel_mid_stream_aborts_and_frees_pages(engine, stub) -> None:
    before = engine.stats().num_generation_tokens
    sampling = pb2.SamplingParams(max_tokens=200, ignore_eos=True)
    call = stub.Generate(pb2.GenerateRequest(text=PROMPT, sampling_params=sampling), timeout=60)
    first, second = next(call), next(call)
    assert not first.finish_reason and not second.finish_reason
    call.cancel()

    deadline = time.monotonic() + 5
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_pages == engine.kv_cache.num_pages
    assert engine.stats().num_generation_tokens - before < 200, "it ran to the end: not aborted"
    with pytest.raises(grpc.RpcError) as error:
        next(call)
    assert error.value.code() == grpc.StatusCode.CANCELLED


def test_health_is_serving_then_not_when_the_engine_stops(front, channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE_NAME):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT)
        assert reply.status == Status.SERVING
    front.shutdown(timeout=5)
    deadline = time.monotonic() + 5
    while health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status == Status.SERVING:
        assert time.monotonic() < deadline, "still SERVING after the engine stopped"
        time.sleep(0.05)


def test_dead_engine_gives_unavailable_and_not_serving(engine, front, stub, channel, monkeypatch):
    def broken_step():
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine, "step", broken_step)
    request = pb2.GenerateRequest(text=PROMPT, sampling_params=pb2.SamplingParams(max_tokens=4))
    for _ in range(2):  # the first call dies with the loop; the next finds it dead
        with pytest.raises(grpc.RpcError) as error:
            generate(stub, request)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "engine" in error.value.details()
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + 5
    while health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status == Status.SERVING:
        assert time.monotonic() < deadline, "still SERVING with a dead engine loop"
        time.sleep(0.05)


def test_reflection_lists_the_services(channel) -> None:
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE_NAME),
    ]
    listed, described = reflection.ServerReflectionInfo(iter(requests), timeout=TIMEOUT)
    names = {s.name for s in listed.list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names
    assert described.file_descriptor_response.file_descriptor_proto  # the .proto, serialized


def _request(text: str | None = PROMPT, ids: list[int] | None = None, **sampling: object):
    prompt = {"text": text} if ids is None else {"token_ids": pb2.TokenIds(ids=ids)}
    if text is None and ids is None:
        prompt = {}
    return pb2.GenerateRequest(**prompt, sampling_params=pb2.SamplingParams(**sampling))


BAD_REQUESTS = {
    "temperature -1": (_request(temperature=-1), "temperature"),
    "top_p 2": (_request(top_p=2), "top_p"),
    "top_k -2": (_request(top_k=-2), "top_k"),
    "min_p 1.5": (_request(min_p=1.5), "min_p"),
    "empty text": (_request(text=""), "prompt"),
    "empty token ids": (_request(ids=[]), "prompt"),
    "no prompt": (_request(text=None), "prompt"),
    "token id out of vocab": (_request(ids=[1, 99999]), "prompt"),
    "negative token id": (_request(ids=[-1]), "prompt"),
    "max_tokens 0": (_request(max_tokens=0), "max_tokens"),
    "over the context": (_request(max_tokens=10**6), "maximum context length"),
    "n 0": (_request(n=0), "n"),
    "n too large": (_request(n=10**6), "n must be in"),
    "logprobs 50": (_request(logprobs=50), "logprobs"),
    "empty stop string": (_request(stop=[""]), "stop"),
    "stop token out of vocab": (_request(stop_token_ids=[10**6]), "stop_token_ids"),
    "logit_bias out of vocab": (_request(logit_bias={10**6: 1.0}), "logit_bias"),
    "min_tokens > max_tokens": (_request(min_tokens=9, max_tokens=4), "min_tokens"),
    "presence_penalty 3": (_request(presence_penalty=3), "presence_penalty"),
}


def test_invalid_arguments_are_refused_with_the_field_named(engine, stub, channel) -> None:
    for case, (request, field_name) in BAD_REQUESTS.items():
        with pytest.raises(grpc.RpcError) as error:
            generate(stub, request)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
        assert field_name in error.value.details(), (case, error.value.details())
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status == Status.SERVING
    good = generate(stub, _request(max_tokens=3, ignore_eos=True, temperature=0))
    assert len(good.token_ids[0]) == 3
    assert not engine.has_unfinished_requests()


def test_tokenize_detokenize_round_trip(stub, tiny) -> None:
    tokenizer = tiny[2]
    text = "Hello, gRPC! ünïcode ✓"
    tokens = stub.Tokenize(pb2.TokenizeRequest(text=text), timeout=TIMEOUT)
    assert list(tokens.token_ids) == tokenizer.encode(text) and tokens.count == len(
        tokens.token_ids
    )
    assert tokens.token_ids[0] == tokenizer.bos_token_id and tokens.max_model_len == 256
    bare = stub.Tokenize(pb2.TokenizeRequest(text=text, add_special_tokens=False), timeout=TIMEOUT)
    assert list(bare.token_ids) == list(tokens.token_ids[1:])
    back = stub.Detokenize(pb2.DetokenizeRequest(token_ids=tokens.token_ids), timeout=TIMEOUT)
    assert back.text == text
    with_specials = pb2.DetokenizeRequest(token_ids=tokens.token_ids, skip_special_tokens=False)
    assert stub.Detokenize(with_specials, timeout=TIMEOUT).text == "<s>" + text
    with pytest.raises(grpc.RpcError) as error:
        stub.Detokenize(pb2.DetokenizeRequest(token_ids=[5, 10**6]), timeout=TIMEOUT)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "token_ids" in error.value.details()


def test_model_info(stub, tiny) -> None:
    cfg, _, tokenizer = tiny
    info = stub.GetModelInfo(pb2.GetModelInfoRequest(), timeout=TIMEOUT)
    assert info.model == MODEL and info.architecture == cfg.architecture
    assert (info.max_model_len, info.vocab_size, info.max_num_seqs) == (256, cfg.vocab_size, 8)
    assert info.bos_token_id == tokenizer.bos_token_id
    assert list(info.eos_token_ids) == list(tokenizer.eos_token_ids)
    assert info.has_chat_template


def test_engine_deltas_become_messages_as_they_are() -> None:
    """Hand-built deltas (no engine): each choice's delta is one message with just its new
    tokens and text; prompt logprobs come once, on the first message; usage on the last."""
    params = SamplingParams(n=2, stop=("xyz",), logprobs=1, prompt_logprobs=1)

    def choice(index: int, text: str, ids: list[int], finish: str | None = None):
        logprobs = [{t: -1.0, 3: -0.2} for t in ids]
        return CompletionOutput(index, text, ids, finish, "xyz" if finish else None, logprobs)

    first = stream_messages(
        RequestOutput(
            "r",
            [choice(0, "ab", [1, 2]), choice(1, "", [7])],
            False,
            prompt_token_ids=[4, 5],
            prompt_logprobs=[None, {5: -0.5, 9: -0.1}],
        ),
        params,
    )
    assert [(m.index, m.text, list(m.token_ids)) for m in first] == [
        (0, "ab", [1, 2]),
        (1, "", [7]),
    ]
    [logprob] = first[0].prompt_logprobs
    assert (logprob.token_id, logprob.logprob, logprob.top_logprobs[0].token_id) == (5, -0.5, 9)
    assert not first[1].prompt_logprobs and not any(m.HasField("usage") for m in first)
    assert [lp.top_logprobs[0].token_id for lp in first[0].logprobs] == [3, 3]
    usage = Usage(prompt_tokens=2, cached_prompt_tokens=1, output_lengths=(3, 1))
    [last] = stream_messages(
        RequestOutput("r", [choice(0, "c", [3], finish="stop")], True, usage=usage), params
    )
    assert (last.text, list(last.token_ids), last.stop_reason.stop_string) == ("c", [3], "xyz")
    assert not last.prompt_logprobs and last.finish_reason == pb2.FINISH_REASON_STOP
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (2, 4)
    assert last.usage.cached_prompt_tokens == 1


def test_structured_outputs_constrain_the_stream(engine, front, stub) -> None:
    """The proto's structured_outputs: the answer under a regex is the engine's own for the
    same constraint (offline) and matches it; a regex that matches nothing is
    INVALID_ARGUMENT naming the problem."""
    regex = "[a-c]{3}-[0-9]{2}"
    sampling = pb2.SamplingParams(temperature=0, max_tokens=16)
    sampling.structured_outputs.regex = regex
    streamed = generate(stub, pb2.GenerateRequest(text=PROMPT, sampling_params=sampling))
    impossible = pb2.SamplingParams(temperature=0, max_tokens=8)
    impossible.structured_outputs.regex = "[a&&b]"
    with pytest.raises(grpc.RpcError) as error:
        list(
            stub.Generate(
                pb2.GenerateRequest(text=PROMPT, sampling_params=impossible), timeout=TIMEOUT
            )
        )
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "matches no output" in error.value.details()
    front.shutdown(timeout=5)
    params = SamplingParams(
        temperature=0, max_tokens=16, structured_outputs=StructuredOutputs(regex=regex)
    )
    expected = offline(engine, PROMPT, params)
    assert streamed.text == {0: expected.outputs[0].text}
    assert re.fullmatch(regex, streamed.text[0]), streamed.text
