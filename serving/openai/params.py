"""OpenAI request fields -> SamplingParams (structured output: serving/openai/structured.py),
and the refusals of what is not implemented."""

from __future__ import annotations

from collections.abc import Mapping

from engine.errors import InvalidRequestError
from engine.request import SamplingParams
from serving.openai.errors import APIError
from serving.openai.protocol import ChatCompletionRequest, CompletionRequest, _Sampling
from serving.openai.structured import structured_outputs

SEED_RANGE = 2**31  # the engine's seeds are u32 and child i uses seed + i: fold user seeds here


def sampling_params(
    body: _Sampling, *, max_tokens: int, logprobs: int | None, vocab_size: int
) -> SamplingParams:
    """Raises InvalidRequestError (400, naming the field) for values out of range."""
    return SamplingParams(
        n=body.n,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=0 if body.top_k is None or body.top_k >= vocab_size else body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=_logit_bias(body.logit_bias),
        seed=None if body.seed is None else body.seed % SEED_RANGE,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        stop=_stop(body.stop),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        include_stop_str_in_output=body.include_stop_str_in_output,
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=body.skip_special_tokens,
        structured_outputs=structured_outputs(body),
    )


def _stop(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _logit_bias(bias: Mapping[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise InvalidRequestError(
            "logit_bias keys must be token ids (integers as strings)", param="logit_bias"
        ) from None


def refuse_unsupported(body: CompletionRequest | ChatCompletionRequest) -> None:
    """A 400 that says so for features not implemented yet, and for fields that contradict
    each other, rather than ignoring them."""
    if body.best_of not in (None, 1):
        _refuse("best_of", "best_of other than 1 is not supported")
    if body.stream_options is not None and not body.stream:
        _refuse("stream_options", "stream_options may only be given with stream: true")
    if isinstance(body, CompletionRequest):
        if body.suffix is not None:
            _refuse("suffix", "suffix (insertion) is not supported")
        return
    if body.functions:
        _refuse("functions", "functions (deprecated by OpenAI) is not supported; use tools")
    if body.top_logprobs is not None and not body.logprobs:
        _refuse("top_logprobs", "top_logprobs requires logprobs to be true")


def _refuse(param: str, message: str) -> None:
    raise APIError(400, message, param=param)
