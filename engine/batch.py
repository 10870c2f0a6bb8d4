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
from engine.scheduler import ScheduledRequest, SchedulerOutput
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

    The leading rows that continue the last batch's decodes (each sequence one token further,
    in any row of the last batch) are written from the last batch with a few whole-batch NumPy
    operations (`_write_kept`) instead of a pass over every sequence's tokens and pages; the
    rows after the first that does not (a prefill chunk, proposals, a sequence that joined) are
    gathered one by one. The rows follow the schedule's order, in which sequences join at the
    end and leave from anywhere, so in a busy server, where some end and others join almost
    every step, nearly every row is kept: what vLLM's persistent batch gives, whose rows stay
    in place instead."""

    def __init__(self, shapes: BatchShapes, page_size: int, eos_token_ids: tuple[int, ...] = ()):
        self.shapes = shapes
        self.page_size = page_size
        self.eos_token_ids = eos_token_ids[:MAX_EOS_IDS]
        self._buffers = [self._allocate(), self._allocate()]
        self._turn = 0
        self._last_requests: list[Request] = []  # the last batch's, in its rows
        self._last_ids: list[str] = []  # their request ids
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
        self,
        out: SchedulerOutput,
        kv_cache: KVCacheManager,
        *,
        penalties: bool,
        constrained: bool = False,
    ) -> StepInput:
        """The scheduled tokens as a host-side StepInput padded to its bucket. `constrained`:
        some row has a grammar, so the batch carries a token bitmask (all ones, for the
        grammars to fill); else its `token_bitmask` is None, every token allowed."""
        t = pick_bucket(max(out.num_tokens, 1), self.shapes.token_buckets)
        s = pick_bucket(max(len(out.scheduled), 1), self.shapes.seq_buckets)
        return self.build_padded(out, kv_cache, t, s, penalties=penalties, constrained=constrained)

    def build_padded(
        self,
        out: SchedulerOutput,
        kv_cache: KVCacheManager | None,
        t: int,
        s: int,
        *,
        penalties: bool,
        constrained: bool = False,
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
        num_seqs = len(requests)
        ids = [request.request_id for request in requests]
        src = self._rows_in_last_batch(requests, ids)
        self._last_requests, self._last_ids = requests, ids
        numbers = _RowNumbers.read(out, kv_cache, ids)
        kept = 0
        # Not with a sliding window: its released pages change a row's earlier entries.
        if kv_cache is not None and kv_cache.sliding_window is None:
            last = self._buffers[self._turn]
            kept = self._write_kept(buf, last, requests, src, numbers, kv_cache)
        offset = kept  # a kept row feeds one token
        if kept < num_seqs:
            assert kv_cache is not None
            k, n = kept, num_seqs
            rows = _Rows.gather(out.scheduled[k:], kv_cache, src[k:].tolist())
            pages = rows.write(
                token_ids[k:], positions[k:], slots[k:], page_table[k:], self.page_size
            )
            self._last_num_pages = np.concatenate([self._last_num_pages[:k], pages])
            counts = np.asarray(rows.counts, np.int32)  # i32[n - k]
            np.cumsum(counts, out=cu_q_lens[k + 1 : n + 1])
            cu_q_lens[k + 1 : n + 1] += k
            kv_lens[k:n] = rows.starts + counts
            offset = k + len(rows.token_ids)
            lora_slots[k:offset] = np.repeat(np.asarray(rows.lora_slots, np.int32), counts)
            token_src[k:][rows.src_at] = rows.src_rows
            for at, following in rows.next_ids:  # prompt logprobs: each token's successor
                next_ids[k + at : k + at + len(following)] = following
        token_ids[offset:t] = 0
        positions[offset:t] = 0
        slots[offset:t] = -1
        lora_slots[offset:t] = 0
        cu_q_lens[num_seqs + 1 : s + 1] = offset
        kv_lens[num_seqs:s] = 0
        logits_indices = buf["logits_indices"]
        logits_indices[:s] = np.maximum(cu_q_lens[1 : s + 1] - 1, 0)
        penalty_len = self.shapes.penalty_len if penalties else 0
        num_outputs = numbers.outputs + numbers.pending
        sampling = self._sampling_cache.tensors(requests, s, penalty_len, src, num_outputs)
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
            sampling=sampling,
            lora_slots=lora_slots[:t],
            token_bitmask=self._bitmask(buf["token_bitmask"], s) if constrained else None,
            token_src=token_src[:t],
        )

    def _rows_in_last_batch(self, requests: list[Request], ids: list[str]) -> np.ndarray:
        """i64[n]: each request's row in the last batch built (-1: it was not in it)."""
        n = len(requests)
        if requests == self._last_requests:  # the same rows (Request compares by identity)
            return self._arange[:n].astype(np.int64)
        last = self._last_ids
        rows = dict(zip(last, range(len(last)), strict=True))
        return np.fromiter(map(rows.get, ids, itertools.repeat(-1)), np.int64, n)

    def _write_kept(
        self,
        buf: dict[str, np.ndarray],
        last: dict[str, np.ndarray],
        requests: list[Request],
        src: np.ndarray,  # i64[n]: each row's row in the last batch, -1 if none
        numbers: _RowNumbers,
        kv_cache: KVCacheManager,
    ) -> int:
        """Writes the leading rows that continue a row of the last batch (`last`'s buffers) by
        one token, from it, and returns how many there are: each starts where that row ended,
        feeds one token past its prompt, and that token is its last output (known on the host)
        or pending on the device (sampled by that row). Like `_Rows.write`, each row gets every
        page its sequence holds (a draft model's steps write past the batch's tokens)."""
        n = len(src)
        starts, pending, outputs = numbers.starts, numbers.pending, numbers.outputs
        kept = (
            (src >= 0)
            & (numbers.counts == 1)
            & (starts == last["kv_lens"][src])  # where its last row ended
            & (starts + 1 == numbers.prompts + outputs + pending)  # its last token, ...
            & (outputs + pending > 0)  # ... past its prompt
            & (pending <= 1)  # (more pending: not the last step's sample)
        )
        k = n if kept.all() else int(kept.argmin())
        if k == 0:
            return 0
        rows, starts, pending = src[:k], starts[:k], pending[:k]
        if not pending.any():  # each row's token is its last output
            tokens = (r.output_token_ids[-1] for r in requests[:k])
            buf["token_ids"][:k] = np.fromiter(tokens, np.int32, k)
        elif pending.all():  # asynchronous: the last step samples it in the row's last row
            buf["token_ids"][:k] = 0
            buf["token_src"][:k] = rows
        else:
            for i, r in enumerate(requests[:k]):
                if pending[i]:
                    buf["token_ids"][i], buf["token_src"][i] = 0, rows[i]
                else:
                    buf["token_ids"][i] = r.output_token_ids[-1]
        buf["positions"][:k] = starts
        buf["kv_lens"][:k] = starts + 1
        buf["cu_q_lens"][: k + 1] = self._arange[: k + 1]
        # an adapter keeps its slot while it runs: the slot of the last row's first token
        buf["lora_slots"][:k] = last["lora_slots"][last["cu_q_lens"][rows]]
        page_table, size = buf["page_table"], self.page_size
        held, num_pages = self._last_num_pages[rows], numbers.pages[:k]
        width = int(held.max())
        page_table[:k, :width] = last["page_table"][rows, :width]
        for row in np.flatnonzero(num_pages > held).tolist():  # pages allocated since
            pages = kv_cache.page_table(requests[row].request_id)
            page_table[row, held[row] : len(pages)] = pages[held[row] :]
        self._last_num_pages = num_pages
        index = starts // size
        buf["slot_mapping"][:k] = page_table[self._arange[:k], index] * size + starts % size
        return k

    def _bitmask(self, buffer: np.ndarray, s: int) -> np.ndarray | None:
        if self.shapes.vocab_size is None:
            return None
        buffer[:s] = -1  # the last batch in this buffer may have had constrained rows
        return buffer[:s]


@dataclass
class _RowNumbers:
    """What the batch needs of each scheduled row as whole-batch arrays, i64[n] each, read in
    one pass over the rows."""

    starts: np.ndarray  # its first position
    counts: np.ndarray  # its tokens in this step
    pending: np.ndarray  # its tokens sampled but still on the device
    prompts: np.ndarray  # its prompt's length
    outputs: np.ndarray  # its outputs known on the host
    pages: np.ndarray  # the pages its sequence holds

    @classmethod
    def read(
        cls, out: SchedulerOutput, kv_cache: KVCacheManager | None, ids: list[str]
    ) -> _RowNumbers:
        flat: list[int] = []
        for row in out.scheduled:
            r = row.request
            flat += (
                row.start, row.num_new_tokens, r.num_pending_tokens, len(r.prompt_token_ids),
                len(r.output_token_ids),
            )  # fmt: skip
        held = [0] * len(ids) if kv_cache is None else kv_cache.num_pages_held_each(ids)
        starts, counts, pending, prompts, outputs = np.array(flat, np.int64).reshape(-1, 5).T
        return cls(starts, counts, pending, prompts, outputs, np.array(held, np.int64))


@dataclass
class _Rows:
    """A step's scheduled sequences as flat lists, gathered in one pass over them, for NumPy to
    write into the batch in a few whole-batch operations."""

    starts: np.ndarray  # i32[n]: each row's first position
    counts: list[int]  # tokens of each row
    lora_slots: list[int]  # each row's adapter slot
    pages: list[list[int]]  # each row's page table
    token_ids: list[int]  # every token of the step (0 where it is pending on the device)
    src_at: list[int]  # tokens pending on the device ...
    src_rows: list[int]  # ... and their rows among the previous step's samples
    next_ids: list[tuple[int, list[int]]]  # (token offset, prompt tokens after each)

    @classmethod
    def gather(
        cls,
        scheduled_rows: list[ScheduledRequest],
        kv_cache: KVCacheManager,
        last_rows: list[int],  # each one's row in the last batch (-1: none)
    ) -> _Rows:
        rows = cls(np.zeros(0, np.int32), [], [], [], [], [], [], [])
        starts: list[int] = []
        tokens = rows.token_ids
        for scheduled, last_row in zip(scheduled_rows, last_rows, strict=True):
            request, start, n = scheduled.request, scheduled.start, scheduled.num_new_tokens
            prompt, output = request.prompt_token_ids, request.output_token_ids
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
                assert last_row >= 0, f"{request.request_id}'s pending token has no row"
                rows.src_rows.append(last_row)
                tokens.append(0)
            if request.sampling_params.prompt_logprobs is not None:
                rows.next_ids.append((offset, prompt[start + 1 : start + n + 1]))
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
    params = [r.sampling_params for r in requests]
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
    return dataclasses.replace(
        _columns(_fixed_values(requests), num_seqs),
        bias_ids=bias_ids,
        bias_values=bias_values,
        output_index=_output_index(requests, num_seqs),
        prompt_ids=prompt_ids,
        output_ids=output_ids,
    )


def _fixed_values(requests: list[Request]) -> np.ndarray:
    """f64[n, 8]: each request's sampling values that stay as they are while it runs, one row
    each, in one pass: f64 holds each exactly (floats as given, integers far below 2**53), so
    each column's cast is the direct one's."""
    return np.array(
        [
            (p.temperature, max(p.top_k, 0), p.top_p, p.min_p, p.repetition_penalty,
             p.presence_penalty, p.frequency_penalty, r.seed)
            for r in requests
            for p in (r.sampling_params,)
        ],
        np.float64,
    ).reshape(len(requests), 8)  # fmt: skip


def _columns(values: np.ndarray, num_seqs: int) -> SamplingTensors:
    """The batch's arrays of `_fixed_values` rows, padded to `num_seqs` rows with the greedy
    defaults; no bias, no penalty ids, `output_index` zero."""
    n = len(values)

    def column(j: int, dtype: type, pad: float) -> np.ndarray:
        array: np.ndarray = np.full(num_seqs, pad, dtype)
        array[:n] = values[:, j]
        return array

    bias_ids, bias_values = no_bias(num_seqs)
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
        output_index=np.zeros(num_seqs, np.int32),
        prompt_ids=np.full((num_seqs, 0), -1, np.int32),
        output_ids=np.full((num_seqs, 0), -1, np.int32),
    )


def _output_index(requests: list[Request], num_seqs: int) -> np.ndarray:
    """i32[S]: each row's output tokens so far, those pending on the device included."""
    output_index = np.zeros(num_seqs, np.int32)
    n = len(requests)
    output_index[:n] = np.fromiter(
        (len(r.output_token_ids) + r.num_pending_tokens for r in requests), np.int32, n
    )
    return output_index


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
    """`sampling_tensors` for a stream of batches, reusing each row's fixed values from the
    last batch's row of the same request (`src`), so that only the rows of requests that
    joined are read from their parameters; the arrays themselves while the batch's rows are
    the last one's (most decode steps): only `output_index` changes then. Batches with a logit
    bias, min_tokens or penalties (whose arrays change as tokens come) are built afresh. The
    returned arrays are never written again, so a device array that aliases one stays valid."""

    def __init__(self, eos_token_ids: tuple[int, ...] = ()) -> None:
        self._eos_token_ids = eos_token_ids
        self._values: np.ndarray | None = None  # f64[n, 8]: the last batch's `_fixed_values`
        self._last: SamplingTensors | None = None

    def tensors(
        self,
        requests: list[Request],
        num_seqs: int,
        penalty_len: int,
        src: np.ndarray,  # i64[n]: each request's row in the last batch, or -1
        num_outputs: np.ndarray,  # i64[n]: each request's outputs, those pending included
    ) -> SamplingTensors:
        n = len(requests)
        last, values = self._last, self._values
        if values is None:  # the last batch was built afresh: nothing to keep
            src = np.full(n, -1, np.int64)
        joined = np.flatnonzero(src < 0).tolist()
        newcomers = [requests[i] for i in joined]
        if penalty_len or any(_biased(r) for r in newcomers):
            self._values = self._last = None
            return sampling_tensors(requests, num_seqs, penalty_len, self._eos_token_ids)
        output_index = np.zeros(num_seqs, np.int32)
        output_index[:n] = num_outputs
        if (
            last is not None
            and values is not None
            and not joined
            and n == len(values)
            and last.temperature.shape[0] == num_seqs
            and (src == np.arange(n)).all()
        ):
            return dataclasses.replace(last, output_index=output_index)
        rows = np.empty((n, 8), np.float64)
        if values is not None:
            rows[src >= 0] = values[src[src >= 0]]
        if joined:
            rows[joined] = _fixed_values(newcomers)
        self._values = rows
        self._last = dataclasses.replace(_columns(rows, num_seqs), output_index=output_index)
        return self._last


def _biased(request: Request) -> bool:
    """A logit bias or min_tokens: its bias rows are built each step (the min_tokens ban
    lifts as tokens come)."""
    p = request.sampling_params
    return bool(p.logit_bias or p.min_tokens)


def _bias(request: Request, eos_token_ids: tuple[int, ...]) -> tuple[list[int], list[float]]:
    """The user's logit bias, plus -inf on EOS and stop ids while min_tokens is not reached."""
    p = request.sampling_params
    bias = dict(p.logit_bias or {})
    if request.num_output_tokens_with_pending < p.min_tokens:
        banned = [*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)]
        bias.update(dict.fromkeys(banned, -np.inf))
    return list(bias), list(bias.values())
