"""Between the gRPC messages and the engine's types: requests in, streamed deltas out.

Host code: plain Python, never imports jax. Every check on a client's input raises
InvalidRequestError naming the field, which the service turns into INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from engine.errors import InvalidRequestError
from engine.request import CompletionOutput, RequestOutput, SamplingParams
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
    params = SamplingParams(**values)  # type: ignore[arg-type]
    return params


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"{param} token id {bad[0]} is out of range for a vocabulary of {vocab_size}",
            param=param,
        )


# ---- streamed outputs --------------------------------------------------------------------------


@dataclass
class _Cursor:
    """How much of one sequence has been sent."""

    num_tokens: int = 0
    num_chars: int = 0
    finished: bool = False


class StreamDeltas:
    """Turns a request's growing RequestOutputs into GenerateResponse deltas.

    The engine's outputs carry each sequence's whole text so far, which a stop string found
    later may still cut; so while a sequence runs, its last `len(longest stop) - 1` characters
    wait (a stop string is only ever found, and cut, within them).
    """

    def __init__(self, params: SamplingParams):
        self._params = params
        self._holdback = max((len(s) for s in params.stop), default=1) - 1
        self._cursors = [_Cursor() for _ in range(params.n)]
        self._sent_prompt_logprobs = False

    def messages(self, output: RequestOutput) -> list[pb2.GenerateResponse]:
        """The messages for what is new in `output`; the stream's last one carries usage."""
        messages = [m for c in output.outputs if (m := self._delta(c)) is not None]
        if output.prompt_logprobs is not None and not self._sent_prompt_logprobs:
            self._first(messages).prompt_logprobs.extend(
                _prompt_logprobs(output, self._params.prompt_logprobs or 0)
            )
            self._sent_prompt_logprobs = True
        if output.finished:
            messages = messages or [pb2.GenerateResponse()]
            messages[-1].usage.CopyFrom(_usage(output))
        return messages

    @staticmethod
    def _first(messages: list[pb2.GenerateResponse]) -> pb2.GenerateResponse:
        if not messages:
            messages.append(pb2.GenerateResponse())
        return messages[0]

    def _delta(self, completion: CompletionOutput) -> pb2.GenerateResponse | None:
        cursor = self._cursors[completion.index]
        if cursor.finished:
            return None
        finished = completion.finish_reason is not None
        text_end = len(completion.text) if finished else len(completion.text) - self._holdback
        text_end = max(text_end, cursor.num_chars)
        new_ids = completion.token_ids[cursor.num_tokens :]
        if not new_ids and text_end == cursor.num_chars and not finished:
            return None
        message = pb2.GenerateResponse(
            index=completion.index,
            token_ids=new_ids,
            text=completion.text[cursor.num_chars : text_end],
            finish_reason=_FINISH_REASONS[completion.finish_reason],
        )
        if completion.logprobs is not None:
            # The engine thread may have appended to this list since `token_ids` was copied.
            entries = completion.logprobs[cursor.num_tokens : len(completion.token_ids)]
            k = self._params.logprobs or 0
            message.logprobs.extend(
                _token_logprob(t, e, k) for t, e in zip(new_ids, entries, strict=True)
            )
        _set_stop_reason(message, completion.stop_reason)
        cursor.num_tokens, cursor.num_chars, cursor.finished = (
            len(completion.token_ids),
            text_end,
            finished,
        )
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
    pairs = zip(output.prompt_token_ids[1:], entries[1:], strict=False)
    return [_token_logprob(t, e, k) for t, e in pairs if e is not None]


def _set_stop_reason(message: pb2.GenerateResponse, reason: int | str | None) -> None:
    if isinstance(reason, str):
        message.stop_reason.stop_string = reason
    elif isinstance(reason, int):
        message.stop_reason.stop_token_id = reason


def _usage(output: RequestOutput) -> pb2.Usage:
    return pb2.Usage(
        prompt_tokens=len(output.prompt_token_ids),
        completion_tokens=sum(len(c.token_ids) for c in output.outputs),
        cached_prompt_tokens=output.num_cached_tokens,
    )
