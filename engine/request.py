"""Requests as the engine tracks them, and the sampling parameters that come with them.

Host code: plain Python, never imports jax.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError
from engine.structured.spec import StructuredOutputs

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries per request, as OpenAI allows
MAX_STOP_TOKEN_IDS = 32
MAX_N = 128  # sequences per request


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's tokens; validated on creation (vLLM's names and defaults)."""

    n: int = 1
    temperature: float = 1.0  # 0 is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) is off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs of each sampled token (0: just the token's)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None  # what the output must match

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # one stop string given where a sequence is expected
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check(1 <= self.n <= MAX_N, "n", f"must be in [1, {MAX_N}], got {self.n}")
        _check(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= -1, "top_k", f"must be -1, 0 (off) or positive, got {self.top_k}")
        _check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(
            self.repetition_penalty > 0,
            "repetition_penalty",
            f"must be > 0, got {self.repetition_penalty}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2 <= value <= 2, name, f"must be in [-2, 2], got {value}")
        _check(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        _check(
            0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or 0 <= value <= MAX_LOGPROBS,
                name,
                f"must be in [0, {MAX_LOGPROBS}], got {value}",
            )
        _check(all(s for s in self.stop), "stop", "stop strings must not be empty")
        _check(
            len(self.logit_bias or {}) <= MAX_LOGIT_BIAS,
            "logit_bias",
            f"may have at most {MAX_LOGIT_BIAS} entries",
        )
        _check(
            len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            "stop_token_ids",
            f"may have at most {MAX_STOP_TOKEN_IDS} entries",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1
            or self.presence_penalty != 0
            or self.frequency_penalty != 0
        )

    @functools.cached_property
    def plain_step(self) -> bool:
        """Whether a step needs nothing for this request but plain sampling: no penalties,
        logprobs, prompt logprobs or grammar (read for every sequence of every step)."""
        return not (
            self.uses_penalties
            or self.logprobs is not None
            or self.prompt_logprobs is not None
            or self.structured_outputs is not None
        )

    def replace(self, **changes: object) -> SamplingParams:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(f"{param} {message}", param=param)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again after its pages were taken; recomputed on resume
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"


@dataclass(eq=False, slots=True)
class Request:
    """One sequence being generated: its tokens so far and where the engine is with it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int  # the sampling seed: the user's, or drawn at creation
    priority: int = 0  # lower is served first (vLLM's convention)
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    num_preemptions: int = 0
    first_token_time: float | None = None
    scheduled_time: float | None = None
    lora_name: str | None = None  # the adapter it runs with (None: the base model)
    lora_slot: int = 0  # the adapter's device slot while it runs (0: the base model)
    cache_salt: bytes = b""  # mixed into its prefix-cache page hashes (the adapter's identity)
    # Tokens sampled by a step still in flight (asynchronous scheduling: 0 or 1), counted by
    # the scheduler but not in output_token_ids until the host reads them.
    num_pending_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        """Known tokens plus those still on the device: what the next step continues from."""
        return self.num_tokens + self.num_pending_tokens

    @property
    def num_output_tokens_with_pending(self) -> int:
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < len(self.prompt_token_ids)


# ---- what the engine hands out -----------------------------------------------------------------
#
# Each engine step returns one RequestOutput per request that made progress, holding only what
# is new since the request's previous output (vLLM's RequestOutputKind.DELTA):
#
#   - `outputs`: one CompletionOutput per choice that gained something this step (a token, or
#     its finish), with just the new token ids, logprobs and text. Text that may still turn out
#     to begin a stop string is held back until it can't; at the finish the rest comes, up to
#     the cut. Joined in order, a choice's deltas are exactly its whole output.
#   - `prompt_token_ids` and `prompt_logprobs`: on the request's first output only.
#   - `usage`: on its last output only (`finished` set), as is each choice's `finish_reason`.
#
# So a request costs work linear in its output, not the sum of every prefix. Callers that want
# the whole answer (`LLM.generate`, non-streamed HTTP) join the deltas with OutputAccumulator,
# whose `output()` is a RequestOutput with every field filled in.


@dataclass(slots=True)
class CompletionOutput:
    """One of a request's n choices: what one step added to it (a delta), or all of it (from
    OutputAccumulator). Not frozen, like RequestOutput: one is made per sequence per step, and
    a frozen dataclass's `__init__` costs several times a plain one's; treat it as read-only."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # set on the choice's last delta
    stop_reason: int | str | None = None  # the stop token id or string that ended it
    logprobs: list[dict[int, float]] | None = None  # one entry per token id, when asked for


@dataclass(frozen=True)
class Usage:
    """A finished request's token counts."""

    prompt_tokens: int
    cached_prompt_tokens: int  # of the prompt, found in the prefix cache
    output_lengths: tuple[int, ...]  # tokens generated by each choice, by index

    @property
    def completion_tokens(self) -> int:
        return sum(self.output_lengths)


@dataclass(slots=True)
class RequestOutput:
    """What a request produced in one step (a delta), or in total (from OutputAccumulator);
    read-only (not frozen: see CompletionOutput)."""

    request_id: str
    outputs: list[CompletionOutput]  # a delta lists only the choices that gained something
    finished: bool
    prompt_token_ids: list[int] | None = None  # on the first delta only
    prompt_logprobs: list[dict[int, float] | None] | None = None  # on the first delta only
    usage: Usage | None = None  # once finished
    arrival_time: float | None = None  # time.monotonic() when the engine took the request
    scheduled_time: float | None = None  # ... when it was first scheduled (queue time: the gap)


@dataclass
class _Choice:
    pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, delta: CompletionOutput) -> None:
        self.pieces.append(delta.text)
        self.token_ids += delta.token_ids
        if delta.logprobs is not None:
            self.logprobs = self.logprobs if self.logprobs is not None else []
            self.logprobs += delta.logprobs
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason

    def output(self, index: int) -> CompletionOutput:
        text = "".join(self.pieces)
        logprobs = list(self.logprobs) if self.logprobs is not None else None
        return CompletionOutput(
            index, text, list(self.token_ids), self.finish_reason, self.stop_reason, logprobs
        )


class OutputAccumulator:
    """Joins one request's deltas, in order, into its whole output so far."""

    def __init__(self) -> None:
        self._choices: dict[int, _Choice] = {}
        self._last: RequestOutput | None = None
        self._first: RequestOutput | None = None

    def add(self, delta: RequestOutput) -> None:
        if self._first is None:
            self._first = delta
        self._last = delta
        for choice in delta.outputs:
            self._choices.setdefault(choice.index, _Choice()).add(choice)

    @property
    def finished(self) -> bool:
        return self._last is not None and self._last.finished

    def output(self) -> RequestOutput:
        """The whole output: every choice seen so far, by index, with all its text and tokens."""
        first, last = self._first, self._last
        if first is None or last is None:
            raise ValueError("no output has been added yet")
        return RequestOutput(
            last.request_id,
            [self._choices[i].output(i) for i in sorted(self._choices)],
            last.finished,
            prompt_token_ids=first.prompt_token_ids,
            prompt_logprobs=first.prompt_logprobs,
            usage=last.usage,
            arrival_time=last.arrival_time,
            scheduled_time=last.scheduled_time,
        )


def validate_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Token ids in the sampling parameters must exist in the vocabulary."""
    for name, ids in (
        ("logit_bias", params.logit_bias or {}),
        ("stop_token_ids", params.stop_token_ids),
    ):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(
                f"{name} token id {bad[0]} is out of range for a vocabulary of {vocab_size}",
                param=name,
            )


def validate_prompt(prompt_token_ids: Sequence[int], vocab_size: int) -> None:
    if not prompt_token_ids:
        raise InvalidRequestError("prompt must contain at least one token", param="prompt")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"prompt token id {bad[0]} is out of range for a vocabulary of {vocab_size}",
            param="prompt",
        )


def context_length_error(max_model_len: int, prompt_len: int, max_tokens: int) -> str:
    """vLLM's wording, which clients match on."""
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{max_tokens} output tokens and your prompt contains {prompt_len} input tokens, for a "
        f"total of {prompt_len + max_tokens} tokens. Please reduce the length of the input "
        f"prompt or the number of requested output tokens."
    )
