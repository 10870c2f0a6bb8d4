"""Between the gRPC messages and the engine's types: requests in, streamed deltas out.

Host code: plain Python, never imports jax. Every check on a client's input raises
InvalidRequestError naming the field, which the service turns into INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from engine.errors import InvalidRequestError
from engine.request import CompletionOutput, RequestOutput, SamplingParams, Usage
from engine.structured.spec import StructuredOutputs
from serving.grpc.stubs import pb2

# SamplingParams fields that are proto3 `optional` scalars: set means given, unset means default.
_SCALARS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "max_tokens",
    "min_tokens",
    "include_stop_str_in_output",
    "ignore_eos",
    "logprobs",
    "prompt_logprobs",
    "skip_special_tokens",
)

_FINISH_REASONS = {
    None: pb2.FINISH_REASON_UNSPECIFIED,
    "stop": pb2.FINISH_REASON_STOP,
    "length": pb2.FINISH_REASON_LENGTH,
    "abort": pb2.FINISH_REASON_ABORT,
}


# ---- requests ----------------------------------------------------------------------------------


def prompt_from_proto(request: pb2.GenerateRequest) -> str | list[int]:
    """The prompt as text or token ids; empty or missing is an error."""
    kind = request.WhichOneof("prompt")
    if kind == "text" and request.text:
        return request.text
    if kind == "token_ids" and request.token_ids.ids:
        return list(request.token_ids.ids)
    raise InvalidRequestError(
        "prompt must be given, as non-empty text or a non-empty list of token ids", param="prompt"
    )


def sampling_params_from_proto(message: pb2.SamplingParams) -> SamplingParams:
    """SamplingParams from the message; SamplingParams validates the values on creation."""
    values: dict[str, object] = {
        name: getattr(message, name) for name in _SCALARS if message.HasField(name)
    }
    if message.logit_bias:
        values["logit_bias"] = dict(message.logit_bias)
    values["stop"] = tuple(message.stop)
    values["stop_token_ids"] = tuple(message.stop_token_ids)
    if message.HasField("structured_outputs"):
        values["structured_outputs"] = structured_outputs_from_proto(message.structured_outputs)
    params = SamplingParams(**values)  # type: ignore[arg-type]
    return params


def structured_outputs_from_proto(message: pb2.StructuredOutputs) -> StructuredOutputs:
    kind = message.WhichOneof("constraint")
    if kind is None:
        raise InvalidRequestError(
            "structured_outputs must set one constraint", param="structured_outputs"
        )
    if kind == "json":
        return StructuredOutputs.from_schema(message.json)
    if kind == "choice":
        return StructuredOutputs(choice=tuple(message.choice.choices))
    return StructuredOutputs(**{kind: getattr(message, kind)})


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"{param} token id {bad[0]} is out of range for a vocabulary of {vocab_size}",
            param=param,
        )


# ---- streamed outputs --------------------------------------------------------------------------


def stream_messages(output: RequestOutput, params: SamplingParams) -> list[pb2.GenerateResponse]:
    """One engine delta as GenerateResponse messages, one per choice that gained something;
    the first delta's first message carries the prompt logprobs, the last delta's last message
    the usage. The engine has already held back any text that a stop string may still cut."""
    messages = [_message(choice, params.logprobs or 0) for choice in output.outputs]
    if output.prompt_logprobs is not None:
        _first(messages).prompt_logprobs.extend(
            _prompt_logprobs(output, params.prompt_logprobs or 0)
        )
    if output.usage is not None:
        messages = messages or [pb2.GenerateResponse()]
        messages[-1].usage.CopyFrom(_usage(output.usage))
    return messages


def _first(messages: list[pb2.GenerateResponse]) -> pb2.GenerateResponse:
    if not messages:
        messages.append(pb2.GenerateResponse())
    return messages[0]


def _message(choice: CompletionOutput, k: int) -> pb2.GenerateResponse:
    message = pb2.GenerateResponse(
        index=choice.index,
        token_ids=choice.token_ids,
        text=choice.text,
        finish_reason=_FINISH_REASONS[choice.finish_reason],
    )
    if choice.logprobs is not None:
        message.logprobs.extend(
            _token_logprob(t, e, k) for t, e in zip(choice.token_ids, choice.logprobs, strict=True)
        )
    _set_stop_reason(message, choice.stop_reason)
    return message


def _token_logprob(token_id: int, entry: Mapping[int, float], k: int) -> pb2.TokenLogprob:
    top = sorted(entry.items(), key=lambda item: -item[1])[:k]
    return pb2.TokenLogprob(
        token_id=token_id,
        logprob=entry[token_id],
        top_logprobs=[pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in top],
    )


def _prompt_logprobs(output: RequestOutput, k: int) -> list[pb2.TokenLogprob]:
    entries = output.prompt_logprobs or []
    pairs = zip((output.prompt_token_ids or [])[1:], entries[1:], strict=False)
    return [_token_logprob(t, e, k) for t, e in pairs if e is not None]


def _set_stop_reason(message: pb2.GenerateResponse, reason: int | str | None) -> None:
    if isinstance(reason, str):
        message.stop_reason.stop_string = reason
    elif isinstance(reason, int):
        message.stop_reason.stop_token_id = reason


def _usage(usage: Usage) -> pb2.Usage:
    return pb2.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_prompt_tokens=usage.cached_prompt_tokens,
    )
