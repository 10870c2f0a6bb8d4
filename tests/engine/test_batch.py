"""BatchBuilder's whole-batch NumPy writes against a row-by-row reference written here: every
array of the StepInput, for random mixes of prefill chunks, decodes, tokens pending on the
device (asynchronous scheduling), speculative proposals, prompt logprobs, adapters, logit
bias and min_tokens."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine.batch import BIAS_WIDTH, BatchBuilder, BatchShapes, no_bias, sampling_tensors
from engine.kv_cache import KVCacheManager
from engine.request import Request, SamplingParams
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.step import StepInput

PAGE = 4
EOS = (1, 2)


def _reference(
    out: SchedulerOutput, kv: KVCacheManager, last: dict[str, int], t: int, s: int
) -> dict[str, np.ndarray]:
    """The step's arrays, one row and one token at a time."""
    a = {k: np.zeros(t, np.int32) for k in ("token_ids", "positions", "lora_slots")}
    a["slot_mapping"] = np.full(t, -1, np.int32)
    a["next_token_ids"] = np.full(t, -1, np.int32)
    a["token_src"] = np.full(t, -1, np.int32)
    a["cu_q_lens"] = np.zeros(s + 1, np.int32)
    a["kv_lens"] = np.zeros(s, np.int32)
    a["page_table"] = np.zeros((s, -(-64 // PAGE)), np.int32)
    offset = 0
    for i, sch in enumerate(out.scheduled):
        r, pages = sch.request, kv.page_table(sch.request.request_id)
        a["page_table"][i, : len(pages)] = pages
        every = r.prompt_token_ids + r.output_token_ids
        known = every[sch.start : sch.start + sch.num_new_tokens - len(sch.draft_token_ids)]
        tokens = known + list(sch.draft_token_ids)
        for j in range(sch.num_new_tokens):
            pos = sch.start + j
            a["positions"][offset + j] = pos
            a["slot_mapping"][offset + j] = pages[pos // PAGE] * PAGE + pos % PAGE
            a["lora_slots"][offset + j] = r.lora_slot
            if j < len(tokens):
                a["token_ids"][offset + j] = tokens[j]
            else:
                a["token_src"][offset + j] = last[r.request_id]
            if r.sampling_params.prompt_logprobs is not None and pos + 1 < len(r.prompt_token_ids):
                a["next_token_ids"][offset + j] = r.prompt_token_ids[pos + 1]
        offset += sch.num_new_tokens
        a["kv_lens"][i] = sch.start + sch.num_new_tokens
        a["cu_q_lens"][i + 1] = offset
    a["cu_q_lens"][len(out.scheduled) + 1 :] = offset
    a["logits_indices"] = np.maximum(a["cu_q_lens"][1:] - 1, 0)
    return a


def _reference_sampling(requests: list[Request], s: int) -> dict[str, np.ndarray]:
    rows: dict[str, list[float]] = {
        "temperature": [0.0] * s, "top_k": [0] * s, "top_p": [1.0] * s, "min_p": [0.0] * s,
        "seeds": [0] * s, "output_index": [0] * s,
    }  # fmt: skip
    bias_ids = np.full((s, BIAS_WIDTH), -1, np.int32)
    bias_values = np.zeros((s, BIAS_WIDTH), np.float32)
    for i, r in enumerate(requests):
        p = r.sampling_params
        rows["temperature"][i], rows["top_k"][i] = p.temperature, max(p.top_k, 0)
        rows["top_p"][i], rows["min_p"][i], rows["seeds"][i] = p.top_p, p.min_p, r.seed
        num_out = len(r.output_token_ids) + r.num_pending_tokens
        rows["output_index"][i] = num_out
        bias = dict(p.logit_bias or {})
        if num_out < p.min_tokens:
            bias.update({t: -np.inf for t in (*p.stop_token_ids, *EOS)})
        for j, (token, value) in enumerate(bias.items()):
            bias_ids[i, j], bias_values[i, j] = token, value
    types = {"top_k": np.int32, "seeds": np.uint32, "output_index": np.int32}
    out = {k: np.asarray(v, types.get(k, np.float32)) for k, v in rows.items()}
    return {**out, "bias_ids": bias_ids, "bias_values": bias_values}


def _random_request(rng: random.Random, i: int) -> Request:
    params = SamplingParams(
        temperature=rng.choice([0.0, 0.7, 1.3]),
        top_k=rng.choice([-1, 0, 5]),
        top_p=rng.choice([1.0, 0.9]),
        min_tokens=rng.choice([0, 0, 3]),
        max_tokens=20,
        stop_token_ids=rng.choice([(), (7,)]),
        logit_bias=rng.choice([None, {5: 1.5, 9: -2.0}]),
        prompt_logprobs=rng.choice([None, None, 2]),
    )
    prompt = [rng.randrange(3, 50) for _ in range(rng.randrange(1, 20))]
    request = Request(f"r{i}", prompt, params, seed=rng.randrange(2**32))
    request.output_token_ids = [rng.randrange(3, 50) for _ in range(rng.randrange(0, 6))]
    request.lora_slot = rng.choice([0, 0, 1, 2])
    return request


def _schedule(rng: random.Random, request: Request, kv: KVCacheManager) -> ScheduledRequest:
    """A random valid row for the request: a prefill chunk, a decode (maybe with proposals) or
    a decode of a token still pending on the device."""
    num_tokens = request.num_tokens
    kind = rng.choice(["chunk", "decode", "draft", "pending"])
    if kind == "chunk":
        start = rng.randrange(0, num_tokens)
        row = ScheduledRequest(request, start, rng.randrange(1, num_tokens - start + 1))
    elif kind == "draft":
        drafts = tuple(rng.randrange(3, 50) for _ in range(rng.randrange(1, 4)))
        row = ScheduledRequest(request, num_tokens - 1, 1 + len(drafts), drafts)
    elif kind == "pending":
        request.num_pending_tokens = 1
        row = ScheduledRequest(request, num_tokens, 1)
    else:
        row = ScheduledRequest(request, num_tokens - 1, 1)
    kv.allocate(request.request_id, row.start + row.num_new_tokens)
    return row


def _check(batch: StepInput, want: dict[str, np.ndarray], sampling: dict[str, np.ndarray]) -> None:
    for name, expected in want.items():
        np.testing.assert_array_equal(getattr(batch, name), expected, err_msg=name)
    for name, expected in sampling.items():
        np.testing.assert_array_equal(getattr(batch.sampling, name), expected, err_msg=name)


@pytest.mark.parametrize("seed", range(8))
def test_batch_equals_the_row_by_row_reference(seed: int) -> None:
    rng = random.Random(seed)
    shapes = BatchShapes.create(
        max_num_batched_tokens=256, max_num_seqs=16, max_model_len=64, page_size=PAGE
    )
    builder = BatchBuilder(shapes, PAGE, eos_token_ids=EOS)
    kv = KVCacheManager(256, PAGE, enable_prefix_caching=False)
    requests = [_random_request(rng, i) for i in range(rng.randrange(1, 17))]
    # A first step decodes each of them, in another order: where pending tokens come from.
    first = SchedulerOutput(
        rng.sample([ScheduledRequest(r, 0, 1) for r in requests], len(requests))
    )
    for row in first.scheduled:
        kv.allocate(row.request.request_id, 1)
    builder.build(first, kv, penalties=False)
    last = {row.request.request_id: i for i, row in enumerate(first.scheduled)}
    out = SchedulerOutput([_schedule(rng, r, kv) for r in rng.sample(requests, len(requests))])
    batch = builder.build(out, kv, penalties=False)
    t, s = batch.token_ids.shape[0], batch.kv_lens.shape[0]
    scheduled = [row.request for row in out.scheduled]
    _check(batch, _reference(out, kv, last, t, s), _reference_sampling(scheduled, s))


def test_unbiased_batches_share_read_only_bias_arrays() -> None:
    """A batch without a logit bias gets the shared no-bias arrays (which the runner keeps on
    the device); a biased one gets its own, and writing its bias leaves the shared ones as
    they were, so a later unbiased batch is not biased."""
    plain = Request("plain", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4), seed=1)
    biased = Request(
        "biased", [1, 2], SamplingParams(temperature=0, max_tokens=4, logit_bias={7: 5.0}), seed=2
    )
    shared_ids, shared_values = no_bias(4)
    assert not shared_ids.flags.writeable and not shared_values.flags.writeable
    unbiased = sampling_tensors([plain], 4, 0)
    assert unbiased.bias_ids is shared_ids and unbiased.bias_values is shared_values
    own = sampling_tensors([plain, biased], 4, 0)
    assert own.bias_ids is not shared_ids and own.bias_values is not shared_values
    assert own.bias_ids[1, 0] == 7 and own.bias_values[1, 0] == 5.0
    np.testing.assert_array_equal(shared_ids, np.full((4, BIAS_WIDTH), -1, np.int32))
    np.testing.assert_array_equal(shared_values, np.zeros((4, BIAS_WIDTH), np.float32))


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seed", range(4))
def test_kept_decode_rows_equal_the_reference(seed: int, asynchronous: bool) -> None:
    """40 steps of decoding, one token a row, with requests joining (a prefill first, of one
    token at times), leaving, trading rows or jumping ahead (as accepted proposals do) now and
    then, some with pages allocated ahead of their tokens: the batches whose leading rows are
    written from the last one (each such sequence one token further, in whatever row it had)
    equal the row-by-row reference as the others do, every page each sequence holds included,
    and most rows take that path.
    Asynchronously, each decoded token is pending on the device when the next batch is built
    (once in a while the host knows them all: a step that needed its tokens)."""
    rng = random.Random(seed)
    shapes = BatchShapes.create(
        max_num_batched_tokens=256, max_num_seqs=16, max_model_len=64, page_size=PAGE
    )
    builder = BatchBuilder(shapes, PAGE, eos_token_ids=EOS)
    kept = total = 0
    write_kept = builder._write_kept

    def counted(*args: object) -> int:
        nonlocal kept
        taken = write_kept(*args)  # type: ignore[arg-type]
        kept += taken
        return taken

    builder._write_kept = counted  # type: ignore[method-assign]
    kv = KVCacheManager(256, PAGE, enable_prefix_caching=False)
    made = iter(range(10**6))

    def new_request() -> Request:
        params = SamplingParams(temperature=rng.choice([0.0, 0.8]), max_tokens=60)
        length = rng.choice([1, rng.randrange(2, 10)])  # one token: a prefill of one row
        prompt = [rng.randrange(3, 50) for _ in range(length)]
        request = Request(f"r{next(made)}", prompt, params, seed=rng.randrange(2**32))
        request.lora_slot = rng.choice([0, 1])
        return request

    running = [new_request() for _ in range(rng.randrange(4, 13))]
    last: dict[str, int] = {}
    for _ in range(40):
        if rng.random() < 0.15 and len(running) > 1:
            kv.free(running.pop(rng.randrange(len(running))).request_id)
        if rng.random() < 0.15 and len(running) < 16:
            running.append(new_request())
        if rng.random() < 0.1:  # two rows trade places (an admission sorted in by priority)
            i, j = rng.sample(range(len(running)), 2) if len(running) > 1 else (0, 0)
            running[i], running[j] = running[j], running[i]
        resolved = not asynchronous or rng.random() < 0.1  # the host waited for every token
        rows = []
        for r in running:
            if r.request_id not in last:  # new: its prompt, in one chunk
                rows.append(ScheduledRequest(r, 0, len(r.prompt_token_ids)))
                continue
            # The tokens sampled by earlier steps that the host reads now: all of them, or
            # (asynchronously) all but the last step's, still pending on the device.
            while r.num_pending_tokens > (0 if resolved else 1):
                r.output_token_ids.append(rng.randrange(3, 50))
                r.num_pending_tokens -= 1
            if rng.random() < 0.03:  # it jumps ahead (a run of accepted proposals)
                r.output_token_ids += [rng.randrange(3, 50), rng.randrange(3, 50)]
            start = r.num_tokens + r.num_pending_tokens - 1
            rows.append(ScheduledRequest(r, start, 1))
        for row in rows:  # at times pages ahead of the tokens, as for proposals
            ahead = rng.choice([0, 0, 0, 0, 5])
            kv.allocate(row.request.request_id, row.start + row.num_new_tokens + ahead)
        out = SchedulerOutput(rows)
        batch = builder.build(out, kv, penalties=False)
        total += len(rows)
        t, s = batch.token_ids.shape[0], batch.kv_lens.shape[0]
        want = _reference(out, kv, last, t, s)
        for i, row in enumerate(rows):  # every page it holds; entries past them are stale
            held = kv.num_pages_held(row.request.request_id)
            np.testing.assert_array_equal(
                batch.page_table[i, :held], want["page_table"][i, :held], err_msg=f"row {i}"
            )
        del want["page_table"]
        _check(batch, want, _reference_sampling([row.request for row in rows], s))
        last = {row.request.request_id: i for i, row in enumerate(rows)}
        for row in rows:  # each row's step samples a token, which the host reads later
            row.request.num_pending_tokens += 1
    assert kept >= total // 2, (kept, total)


def test_rows_that_trade_places_keep_their_own_pages() -> None:
    """Two sequences at the same position trade rows (an admission sorted in between them
    would do it): every check on the rows' positions and tokens holds either way, so only the
    rows' identities tell which of the last batch's rows each continues."""
    shapes = BatchShapes.create(
        max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64, page_size=PAGE
    )
    builder = BatchBuilder(shapes, PAGE, eos_token_ids=EOS)
    kv = KVCacheManager(64, PAGE, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=30)
    a = Request("a", [5, 6, 7], params, seed=1)
    b = Request("b", [8, 9, 10], params, seed=2)
    order, last = [a, b], {}
    for step in range(6):
        if step == 4:
            order = [b, a]
        for r in order:
            r.output_token_ids.append(11 + step + 10 * (r is b))  # each its own tokens
        rows = [ScheduledRequest(r, r.num_tokens - 1, 1) for r in order]
        for row in rows:
            kv.allocate(row.request.request_id, row.start + 1)
        out = SchedulerOutput(rows)
        batch = builder.build(out, kv, penalties=False)
        t, s = batch.token_ids.shape[0], batch.kv_lens.shape[0]
        want = _reference(out, kv, last, t, s)
        _check(batch, want, _reference_sampling(order, s))
        last = {row.request.request_id: i for i, row in enumerate(rows)}
