"""SchedulerOutput -> StepInput: the ragged batch packed into preallocated NumPy buffers,
padded to a (tokens, sequences) bucket, ready for one `device_put`.

Boundary code: NumPy only; the model runner moves the result to the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.kv_cache import KVCacheManager
from engine.request import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, Request
from engine.sampling import SamplingTensors, bitmask_words
from engine.scheduler import SchedulerOutput
from engine.step import StepInput

MIN_TOKEN_BUCKET = 1
MAX_EOS_IDS = 8
# Logit-bias slots per sequence: the user's bias, then the ids banned until min_tokens.
BIAS_WIDTH = MAX_LOGIT_BIAS + MAX_STOP_TOKEN_IDS + MAX_EOS_IDS


def power_of_two_buckets(smallest: int, largest: int) -> tuple[int, ...]:
    """smallest, 2*smallest, ... and `largest` itself (so the maximum is always a bucket)."""
    buckets = []
    size = smallest
    while size < largest:
        buckets.append(size)
        size *= 2
    return (*buckets, largest)


def pick_bucket(n: int, buckets: tuple[int, ...]) -> int:
    for size in buckets:
        if n <= size:
            return size
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclass(frozen=True)
class BatchShapes:
    """The static shapes a step can have; one compiled step per (T, S) pair with S <= T."""

    token_buckets: tuple[int, ...]
    seq_buckets: tuple[int, ...]
    pages_per_seq: int  # P: page-table width, enough for max_model_len
    penalty_len: int  # prompt/output id lists for penalties are padded to this
    vocab_size: int | None = None  # V, for the token bitmask; None: batches carry none

    @classmethod
    def create(
        cls,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        page_size: int,
        vocab_size: int | None = None,
    ) -> BatchShapes:
        return cls(
            token_buckets=power_of_two_buckets(
                min(MIN_TOKEN_BUCKET, max_num_batched_tokens), max_num_batched_tokens
            ),
            seq_buckets=power_of_two_buckets(1, max_num_seqs),
            pages_per_seq=-(-max_model_len // page_size),
            penalty_len=max_model_len,
            vocab_size=vocab_size,
        )

    def all_pairs(self) -> list[tuple[int, int]]:
        return [(t, s) for t in self.token_buckets for s in self.seq_buckets if s <= t]


class BatchBuilder:
    """Fills two alternating sets of NumPy buffers (a buffer may still be aliased by the
    device array of the step in flight, so the next step writes the other set).

    A token still pending on the device (asynchronous scheduling) is read there: `token_src`
    names its row among the tokens the previously built step samples, which this builder
    remembers."""

    def __init__(self, shapes: BatchShapes, page_size: int, eos_token_ids: tuple[int, ...] = ()):
        self.shapes = shapes
        self.page_size = page_size
        self.eos_token_ids = eos_token_ids[:MAX_EOS_IDS]
        self._buffers = [self._allocate(), self._allocate()]
        self._turn = 0
        self._last_rows: dict[str, int] = {}  # request id -> its row in the last batch built

    def _allocate(self) -> dict[str, np.ndarray]:
        t, s, p = (
            self.shapes.token_buckets[-1],
            self.shapes.seq_buckets[-1],
            self.shapes.pages_per_seq,
        )
        vocab = self.shapes.vocab_size
        words = 0 if vocab is None else bitmask_words(vocab)
        return {
            # All ones as built; structured output's matchers fill their rows (ModelRunner).
            "token_bitmask": np.full((s, words), -1, np.int32),
            "token_ids": np.zeros(t, np.int32),
            "positions": np.zeros(t, np.int32),
            "slot_mapping": np.full(t, -1, np.int32),
            "cu_q_lens": np.zeros(s + 1, np.int32),
            "kv_lens": np.zeros(s, np.int32),
            "page_table": np.zeros((s, p), np.int32),
            "logits_indices": np.zeros(s, np.int32),
            "next_token_ids": np.full(t, -1, np.int32),
            "token_src": np.full(t, -1, np.int32),
            "lora_slots": np.zeros(t, np.int32),
        }

    def build(
        self, out: SchedulerOutput, kv_cache: KVCacheManager, *, penalties: bool
    ) -> StepInput:
        """The scheduled tokens as a host-side StepInput padded to its bucket."""
        t = pick_bucket(max(out.num_tokens, 1), self.shapes.token_buckets)
        s = pick_bucket(max(len(out.scheduled), 1), self.shapes.seq_buckets)
        return self.build_padded(out, kv_cache, t, s, penalties=penalties)

    def build_padded(
        self,
        out: SchedulerOutput,
        kv_cache: KVCacheManager | None,
        t: int,
        s: int,
        *,
        penalties: bool,
    ) -> StepInput:
        """Like `build`, into the (t, s) bucket; an empty `out` gives an all-padding batch."""
        buf = self._buffers[self._turn]
        self._turn ^= 1
        token_ids, positions, slots = buf["token_ids"], buf["positions"], buf["slot_mapping"]
        cu_q_lens, kv_lens, page_table = buf["cu_q_lens"], buf["kv_lens"], buf["page_table"]
        next_ids, lora_slots, token_src = buf["next_token_ids"], buf["lora_slots"], buf["token_src"]
        next_ids[:t] = -1
        token_src[:t] = -1
        offset = 0
        rows = {}
        for i, scheduled in enumerate(out.scheduled):
            assert kv_cache is not None
            request, start, n = scheduled.request, scheduled.start, scheduled.num_new_tokens
            rows[request.request_id] = i
            pages = kv_cache.page_table(request.request_id)
            page_table[i, : len(pages)] = pages
            # every token is known but a pending one (speculation is never asynchronous)
            known = n if scheduled.draft_token_ids else min(request.num_tokens - start, n)
            if n == 1:  # a decode, most rows of most steps: scalar writes, no NumPy temporaries
                positions[offset] = start
                slots[offset] = pages[start // self.page_size] * self.page_size + (
                    start % self.page_size
                )
                token_ids[offset] = _token_at(request, start) if known else 0
            else:
                table = np.asarray(pages, np.int32)
                pos = np.arange(start, start + n, dtype=np.int32)
                token_ids[offset : offset + known] = scheduled.token_ids
                positions[offset : offset + n] = pos
                slots[offset : offset + n] = table[pos // self.page_size] * self.page_size + (
                    pos % self.page_size
                )
            if known < n:  # the last token is pending: the previous step samples it
                token_src[offset + known] = self._last_rows[request.request_id]
                token_ids[offset + known] = 0
            if request.sampling_params.prompt_logprobs is not None:
                following = request.prompt_token_ids[start + 1 : start + n + 1]
                next_ids[offset : offset + len(following)] = following
            kv_lens[i] = start + n
            lora_slots[offset : offset + n] = request.lora_slot
            offset += n
            cu_q_lens[i + 1] = offset
        num_seqs = len(out.scheduled)
        self._last_rows = rows
        token_ids[offset:t] = 0
        positions[offset:t] = 0
        slots[offset:t] = -1
        lora_slots[offset:t] = 0
        cu_q_lens[num_seqs + 1 : s + 1] = offset
        kv_lens[num_seqs:s] = 0
        logits_indices = buf["logits_indices"]
        logits_indices[:s] = np.maximum(cu_q_lens[1 : s + 1] - 1, 0)
        return StepInput(
            token_ids=token_ids[:t],
            positions=positions[:t],
            slot_mapping=slots[:t],
            cu_q_lens=cu_q_lens[: s + 1],
            kv_lens=kv_lens[:s],
            page_table=page_table[:s],
            num_seqs=np.int32(num_seqs),
            logits_indices=logits_indices[:s],
            next_token_ids=next_ids[:t],
            sampling=self._sampling(out, s, penalties=penalties),
            lora_slots=lora_slots[:t],
            token_bitmask=self._bitmask(buf["token_bitmask"], s),
            token_src=token_src[:t],
        )

    def _bitmask(self, buffer: np.ndarray, s: int) -> np.ndarray | None:
        if self.shapes.vocab_size is None:
            return None
        buffer[:s] = -1  # the last batch in this buffer may have had constrained rows
        return buffer[:s]

    def _sampling(self, out: SchedulerOutput, s: int, *, penalties: bool) -> SamplingTensors:
        requests = [scheduled.request for scheduled in out.scheduled]
        penalty_len = self.shapes.penalty_len if penalties else 0
        return sampling_tensors(requests, s, penalty_len, self.eos_token_ids)


def _token_at(request: Request, position: int) -> int:
    """The request's token at `position` (without joining prompt and output)."""
    prompt = request.prompt_token_ids
    if position < len(prompt):
        return prompt[position]
    return request.output_token_ids[position - len(prompt)]


def sampling_tensors(
    requests: list[Request],
    num_seqs: int,
    penalty_len: int,
    eos_token_ids: tuple[int, ...] = (),
) -> SamplingTensors:
    """Per-sequence sampling arrays for `requests`, padded to `num_seqs` rows with greedy
    defaults. Penalty id lists are only filled when `penalty_len` > 0."""
    n = len(requests)
    params = [r.sampling_params for r in requests]

    def column(values: list[float] | list[int], dtype: type, pad: float) -> np.ndarray:
        array: np.ndarray = np.full(num_seqs, pad, dtype)
        array[:n] = values
        return array

    bias_ids = np.full((num_seqs, BIAS_WIDTH), -1, np.int32)
    bias_values = np.zeros((num_seqs, BIAS_WIDTH), np.float32)
    for i, r in enumerate(requests):
        ids, values = _bias(r, eos_token_ids)
        bias_ids[i, : len(ids)] = ids
        bias_values[i, : len(ids)] = values
    prompt_ids = np.full((num_seqs, penalty_len), -1, np.int32)
    output_ids = np.full((num_seqs, penalty_len), -1, np.int32)
    if penalty_len:
        for i, r in enumerate(requests):
            prompt_ids[i, : len(r.prompt_token_ids)] = r.prompt_token_ids
            output_ids[i, : len(r.output_token_ids)] = r.output_token_ids
    return SamplingTensors(
        temperature=column([p.temperature for p in params], np.float32, 0.0),
        top_k=column([max(p.top_k, 0) for p in params], np.int32, 0),
        top_p=column([p.top_p for p in params], np.float32, 1.0),
        min_p=column([p.min_p for p in params], np.float32, 0.0),
        repetition_penalty=column([p.repetition_penalty for p in params], np.float32, 1.0),
        presence_penalty=column([p.presence_penalty for p in params], np.float32, 0.0),
        frequency_penalty=column([p.frequency_penalty for p in params], np.float32, 0.0),
        bias_ids=bias_ids,
        bias_values=bias_values,
        seeds=column([r.seed for r in requests], np.uint32, 0),
        output_index=column([r.num_output_tokens_with_pending for r in requests], np.int32, 0),
        prompt_ids=prompt_ids,
        output_ids=output_ids,
    )


def _bias(request: Request, eos_token_ids: tuple[int, ...]) -> tuple[list[int], list[float]]:
    """The user's logit bias, plus -inf on EOS and stop ids while min_tokens is not reached."""
    p = request.sampling_params
    bias = dict(p.logit_bias or {})
    if request.num_output_tokens_with_pending < p.min_tokens:
        banned = [*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)]
        bias.update(dict.fromkeys(banned, -np.inf))
    return list(bias), list(bias.values())
