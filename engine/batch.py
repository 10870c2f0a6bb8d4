"""SchedulerOutput -> StepInput: the ragged batch packed into preallocated NumPy buffers,
padded to a (tokens, sequences) bucket, ready for one `device_put`.

Boundary code: NumPy only; the model runner moves the result to the device.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
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
    remembers.

    A steady decode step (the same sequences as the last batch, in the same rows, each one
    token further: no sequence joined, left or moved) is written from the last batch with a
    few whole-batch NumPy operations (`_write_steady`) instead of a pass over every sequence's
    tokens and pages: a narrow form of vLLM's persistent batch, which also keeps its rows
    through joins and leaves."""

    def __init__(self, shapes: BatchShapes, page_size: int, eos_token_ids: tuple[int, ...] = ()):
        self.shapes = shapes
        self.page_size = page_size
        self.eos_token_ids = eos_token_ids[:MAX_EOS_IDS]
        self._buffers = [self._allocate(), self._allocate()]
        self._turn = 0
        self._last_rows: dict[str, int] = {}  # request id -> its row in the last batch built
        # The last batch's requests if each of its rows was one token past its prompt (no
        # prefill chunk, no draft tokens), else None: the next batch may then be steady.
        self._last_decode: list[Request] | None = None
        self._last_num_pages = np.zeros(0, np.int64)  # the pages each row held in it
        longest = max(shapes.token_buckets[-1], shapes.seq_buckets[-1])
        self._arange = np.arange(longest + 1, dtype=np.int32)  # row and token numbers
        self._sampling_cache = SamplingCache(self.eos_token_ids)

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
        requests = [scheduled.request for scheduled in out.scheduled]
        num_seqs = offset = len(requests)
        steady = (
            kv_cache is not None
            and num_seqs > 0
            and requests == self._last_decode  # Request compares by identity
            and out.num_tokens == num_seqs
            and kv_cache.sliding_window is None  # (released pages change earlier entries)
            and self._write_steady(buf, self._buffers[self._turn], out, requests, kv_cache)
        )
        if not steady:
            rows = _Rows.gather(out, kv_cache, self._last_rows)
            self._last_rows = rows.index
            self._last_decode = requests if rows.decode_only else None
            offset = len(rows.token_ids)
            if num_seqs:
                self._last_num_pages = rows.write(
                    token_ids, positions, slots, page_table, self.page_size
                )
                counts = np.asarray(rows.counts, np.int32)  # i32[n]
                np.cumsum(counts, out=cu_q_lens[1 : num_seqs + 1])
                kv_lens[:num_seqs] = rows.starts + counts
                lora_slots[:offset] = np.repeat(np.asarray(rows.lora_slots, np.int32), counts)
                token_src[rows.src_at] = rows.src_rows
                for at, following in rows.next_ids:  # prompt logprobs: each token's successor
                    next_ids[at : at + len(following)] = following
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
            sampling=self._sampling(requests, s, penalties=penalties),
            lora_slots=lora_slots[:t],
            token_bitmask=self._bitmask(buf["token_bitmask"], s),
            token_src=token_src[:t],
        )

    def _write_steady(
        self,
        buf: dict[str, np.ndarray],
        last: dict[str, np.ndarray],
        out: SchedulerOutput,
        requests: list[Request],
        kv_cache: KVCacheManager,
    ) -> bool:
        """Writes the first rows of a batch whose sequences are the last batch's, in the same
        rows, where each row fed one token past its prompt, from `last`'s buffers, if each row
        now feeds its next one: it starts where its last step ended and its token is its last
        (known on the host, or pending on the device for every row). Else False, having
        written nothing. Like `_Rows.write`, each row gets every page its sequence holds (a
        draft model's steps write past the batch's tokens)."""
        n = len(requests)
        starts = np.fromiter((scheduled.start for scheduled in out.scheduled), np.int32, n)
        if not np.array_equal(starts, last["kv_lens"][:n]):  # so each is past its prompt
            return False
        pending = np.fromiter((r.num_pending_tokens for r in requests), np.int32, n)
        ends = np.fromiter((r.num_tokens for r in requests), np.int32, n) + pending
        if not np.array_equal(starts + 1, ends):
            return False
        if not pending.any():  # each row's token is its last output (it is past its prompt)
            tokens = (r.output_token_ids[-1] for r in requests)
            buf["token_ids"][:n] = np.fromiter(tokens, np.int32, n)
        elif (pending == 1).all():  # asynchronous: the last step samples row i's token in row i
            buf["token_ids"][:n] = 0
            buf["token_src"][:n] = self._arange[:n]
        else:
            return False
        buf["positions"][:n] = starts
        buf["kv_lens"][:n] = starts + 1
        buf["cu_q_lens"][: n + 1] = self._arange[: n + 1]
        buf["lora_slots"][:n] = last["lora_slots"][:n]  # an adapter keeps its slot while it runs
        page_table, size, held = buf["page_table"], self.page_size, self._last_num_pages
        width = int(held.max())
        page_table[:n, :width] = last["page_table"][:n, :width]
        held_now = (kv_cache.num_pages_held(r.request_id) for r in requests)
        num_pages = np.fromiter(held_now, np.int64, n)
        for row in np.flatnonzero(num_pages > held).tolist():  # pages allocated since
            pages = kv_cache.page_table(requests[row].request_id)
            page_table[row, held[row] : len(pages)] = pages[held[row] :]
        self._last_num_pages = num_pages
        index = starts // size
        buf["slot_mapping"][:n] = page_table[self._arange[:n], index] * size + starts % size
        return True

    def _bitmask(self, buffer: np.ndarray, s: int) -> np.ndarray | None:
        if self.shapes.vocab_size is None:
            return None
        buffer[:s] = -1  # the last batch in this buffer may have had constrained rows
        return buffer[:s]

    def _sampling(self, requests: list[Request], s: int, *, penalties: bool) -> SamplingTensors:
        penalty_len = self.shapes.penalty_len if penalties else 0
        return self._sampling_cache.tensors(requests, s, penalty_len)


@dataclass
class _Rows:
    """A step's scheduled sequences as flat lists, gathered in one pass over them, for NumPy to
    write into the batch in a few whole-batch operations."""

    index: dict[str, int]  # request id -> its row
    starts: np.ndarray  # i32[n]: each row's first position
    counts: list[int]  # tokens of each row
    lora_slots: list[int]  # each row's adapter slot
    pages: list[list[int]]  # each row's page table
    token_ids: list[int]  # every token of the step (0 where it is pending on the device)
    src_at: list[int]  # tokens pending on the device ...
    src_rows: list[int]  # ... and their rows among the previous step's samples
    next_ids: list[tuple[int, list[int]]]  # (token offset, prompt tokens after each)
    decode_only: bool = True  # every row is one token past its prompt (no draft tokens)

    @classmethod
    def gather(
        cls, out: SchedulerOutput, kv_cache: KVCacheManager | None, last_rows: dict[str, int]
    ) -> _Rows:
        rows = cls({}, np.zeros(0, np.int32), [], [], [], [], [], [], [])
        starts: list[int] = []
        tokens = rows.token_ids
        for i, scheduled in enumerate(out.scheduled):
            assert kv_cache is not None
            request, start, n = scheduled.request, scheduled.start, scheduled.num_new_tokens
            prompt, output = request.prompt_token_ids, request.output_token_ids
            rows.index[request.request_id] = i
            rows.pages.append(kv_cache.page_table(request.request_id))
            offset = len(tokens)
            # every token is known but a pending one (speculation is never asynchronous)
            num_tokens = len(prompt) + len(output)
            known = n if scheduled.draft_token_ids else min(num_tokens - start, n)
            if n == 1 and known:  # a decode, most rows of most steps: no joined token list
                tokens.append(prompt[start] if start < len(prompt) else output[start - len(prompt)])
            elif known:
                tokens += scheduled.token_ids
            if known < n:  # the last token is pending: the previous step samples it
                rows.src_at.append(offset + known)
                rows.src_rows.append(last_rows[request.request_id])
                tokens.append(0)
            if request.sampling_params.prompt_logprobs is not None:
                rows.next_ids.append((offset, prompt[start + 1 : start + n + 1]))
                rows.decode_only = False
            elif n != 1 or start < len(prompt):  # a prefill chunk or draft tokens
                rows.decode_only = False
            starts.append(start)
            rows.counts.append(n)
            rows.lora_slots.append(request.lora_slot)
        rows.starts = np.asarray(starts, np.int32)
        return rows

    def write(
        self,
        token_ids: np.ndarray,  # i32[T]
        positions: np.ndarray,  # i32[T]
        slots: np.ndarray,  # i32[T]
        page_table: np.ndarray,  # i32[S, P]
        page_size: int,
    ) -> np.ndarray:
        """Fills the first rows of the page table (each row's pages; entries past them are left
        as they are) and the tokens' ids, positions and slots; returns each row's number of
        pages, i64[n]."""
        n, total = len(self.counts), len(self.token_ids)
        lengths = np.fromiter(map(len, self.pages), np.int64, n)
        flat = np.fromiter(itertools.chain.from_iterable(self.pages), np.int32, int(lengths.sum()))
        first = np.repeat(np.cumsum(lengths) - lengths, lengths)  # each entry's row start
        page_table[np.repeat(np.arange(n), lengths), np.arange(len(flat)) - first] = flat
        token_ids[:total] = self.token_ids
        counts = np.asarray(self.counts, np.int64)
        row = np.repeat(np.arange(n), counts)  # each token's row
        pos = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts) + self.starts[row]
        positions[:total] = pos
        slots[:total] = page_table[row, pos // page_size] * page_size + pos % page_size
        return lengths


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
    # One row of the per-sequence columns per request, in one pass: f64 holds each exactly
    # (floats as given, integers far below 2**53), so each column's cast is the direct one's.
    values = np.array(
        [
            (p.temperature, max(p.top_k, 0), p.top_p, p.min_p, p.repetition_penalty,
             p.presence_penalty, p.frequency_penalty, r.seed,
             len(r.output_token_ids) + r.num_pending_tokens)
            for r, p in zip(requests, params, strict=True)
        ],
        np.float64,
    ).reshape(n, 9)  # fmt: skip

    def column(j: int, dtype: type, pad: float) -> np.ndarray:
        array: np.ndarray = np.full(num_seqs, pad, dtype)
        array[:n] = values[:, j]
        return array

    biased = [
        (i, r)
        for i, (r, p) in enumerate(zip(requests, params, strict=True))
        if p.logit_bias or len(r.output_token_ids) + r.num_pending_tokens < p.min_tokens
    ]
    bias_ids, bias_values = no_bias(num_seqs)
    if biased:
        bias_ids, bias_values = bias_ids.copy(), bias_values.copy()
    for i, r in biased:
        ids, bias = _bias(r, eos_token_ids)
        bias_ids[i, : len(ids)] = ids
        bias_values[i, : len(ids)] = bias
    prompt_ids = np.full((num_seqs, penalty_len), -1, np.int32)
    output_ids = np.full((num_seqs, penalty_len), -1, np.int32)
    if penalty_len:
        for i, r in enumerate(requests):
            prompt_ids[i, : len(r.prompt_token_ids)] = r.prompt_token_ids
            output_ids[i, : len(r.output_token_ids)] = r.output_token_ids
    return SamplingTensors(
        temperature=column(0, np.float32, 0.0),
        top_k=column(1, np.int32, 0),
        top_p=column(2, np.float32, 1.0),
        min_p=column(3, np.float32, 0.0),
        repetition_penalty=column(4, np.float32, 1.0),
        presence_penalty=column(5, np.float32, 0.0),
        frequency_penalty=column(6, np.float32, 0.0),
        bias_ids=bias_ids,
        bias_values=bias_values,
        seeds=column(7, np.uint32, 0),
        output_index=column(8, np.int32, 0),
        prompt_ids=prompt_ids,
        output_ids=output_ids,
    )


@functools.cache
def no_bias(num_seqs: int) -> tuple[np.ndarray, np.ndarray]:
    """The bias arrays (ids, values) of `num_seqs` rows none of which has a bias, shared by
    every batch without one and never written: the largest of a step's inputs (BIAS_WIDTH
    entries a row), which the runner therefore keeps on the device (`ModelRunner`)."""
    ids = np.full((num_seqs, BIAS_WIDTH), -1, np.int32)
    values = np.zeros((num_seqs, BIAS_WIDTH), np.float32)
    ids.flags.writeable = values.flags.writeable = False
    return ids, values


class SamplingCache:
    """`sampling_tensors` for a stream of batches, reusing the last batch's arrays while its
    requests are the same ones in the same order (most decode steps): only `output_index`
    changes then. Batches with a logit bias, min_tokens or penalties (whose arrays change as
    tokens come) are built afresh. The reused arrays are never written again, so a device
    array that aliases one of them stays valid."""

    def __init__(self, eos_token_ids: tuple[int, ...] = ()) -> None:
        self._eos_token_ids = eos_token_ids
        self._requests: list[Request] = []
        self._last: SamplingTensors | None = None

    def tensors(self, requests: list[Request], num_seqs: int, penalty_len: int) -> SamplingTensors:
        last = self._last
        if (
            last is None
            or penalty_len
            or requests != self._requests  # Request compares by identity
            or last.temperature.shape[0] != num_seqs
        ):
            tensors = sampling_tensors(requests, num_seqs, penalty_len, self._eos_token_ids)
            static = not penalty_len and not any(
                r.sampling_params.logit_bias or r.sampling_params.min_tokens for r in requests
            )
            self._requests, self._last = (requests, tensors) if static else ([], None)
            return tensors
        output_index = np.zeros(num_seqs, np.int32)  # i32[S]
        n = len(requests)
        output_index[:n] = np.fromiter(
            (len(r.output_token_ids) + r.num_pending_tokens for r in requests), np.int32, n
        )
        return dataclasses.replace(last, output_index=output_index)


def _bias(request: Request, eos_token_ids: tuple[int, ...]) -> tuple[list[int], list[float]]:
    """The user's logit bias, plus -inf on EOS and stop ids while min_tokens is not reached."""
    p = request.sampling_params
    bias = dict(p.logit_bias or {})
    if request.num_output_tokens_with_pending < p.min_tokens:
        banned = [*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)]
        bias.update(dict.fromkeys(banned, -np.inf))
    return list(bias), list(bias.values())
