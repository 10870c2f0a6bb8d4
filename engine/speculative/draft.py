"""Proposers: where speculative tokens come from. `NgramProposer` looks them up on the host;
`DraftModelProposer` runs a smaller model with the same vocabulary in the same engine. (An
EAGLE-style head is another proposer: it would read the target's hidden states, which the
verification forward already returns.)

The draft model has its own paged KV cache with the target's page ids: a page the allocator
hands out holds both models' K/V for the same tokens, so the target's page tables, prefix
cache and preemption serve the draft unchanged. To keep its cache in step, the draft runs
every step's known tokens (plain steps too, `follow`); to propose, it then runs K one-token
steps per sequence, feeding each proposal back, the last only to write its K/V (so that an
all-accepted run leaves the draft's cache complete). Over a device mesh the draft is sharded as
the target is (its layout must fit the draft's head and layer counts too).

Boundary code: host bookkeeping and device dispatch; the math is in rejection.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import Mesh

from engine.batch import pick_bucket, sampling_tensors
from engine.compiled_step import Variant
from engine.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from engine.kv_cache import KVCacheManager
from engine.model_runner import ModelRunner
from engine.models.attention import AttentionMetadata
from engine.models.layers import Params
from engine.scheduler import SchedulerOutput
from engine.speculative import ngram
from engine.speculative.rejection import draft_sample, draft_sample_step, jitted_draft_sample
from engine.step import StepInput, attention_metadata
from sharding.layout import ShardingLayout


@dataclass(frozen=True)
class Proposals:
    """Per scheduled sequence, its proposed tokens (at most the room it was given)."""

    drafts: list[list[int]]
    probs: Any = None  # f32[S, K, V] on the device: the draft distributions; None: one-hot


class Proposer(Protocol):
    def propose(self, out: SchedulerOutput, rooms: list[int], kv: KVCacheManager) -> Proposals:
        """Proposals for `out`'s sequences, up to `rooms[i]` tokens for sequence i (pages are
        allocated for them)."""
        ...

    def follow(self, out: SchedulerOutput, kv: KVCacheManager) -> None:
        """A step that proposes nothing is about to run `out`."""
        ...

    def warm_up_one(self) -> bool:
        """Compiles one part not compiled yet; False when all are."""
        ...


class NgramProposer:
    """Prompt lookup (engine/speculative/ngram.py) on each sequence's own tokens."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def propose(self, out: SchedulerOutput, rooms: list[int], kv: KVCacheManager) -> Proposals:
        drafts = []
        for scheduled, room in zip(out.scheduled, rooms, strict=True):
            found: list[int] = []
            if room > 0:
                tokens = np.asarray(scheduled.request.all_token_ids, np.int32)
                lookup = ngram.propose(
                    tokens,
                    min_n=self.config.prompt_lookup_min,
                    max_n=self.config.prompt_lookup_max,
                    k=room,
                )
                found = [int(t) for t in lookup]
            drafts.append(found)
        return Proposals(drafts)

    def follow(self, out: SchedulerOutput, kv: KVCacheManager) -> None:
        pass

    def warm_up_one(self) -> bool:
        return False


class DraftModelProposer:
    """A draft model's proposals, drawn with the plain sampler's keys (rejection.draft_sample)."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: Params,
        target: ModelRunner,
        scheduler_config: SchedulerConfig,
        config: SpeculativeConfig,
        mesh: Mesh | None = None,
        layout: ShardingLayout | None = None,
    ):
        """`mesh`, `layout`: the target's, over which the draft is sharded the same way."""
        cache = CacheConfig(page_size=target.page_size, num_pages=target.num_pages)
        self.runner = ModelRunner(cfg, params, cache, scheduler_config, mesh=mesh, layout=layout)
        self.k = config.num_speculative_tokens
        self._to_compile = [v for v in self.runner.compiled.variants() if v.kind == "forward"]
        self._samplers: dict[int, Any] = {}

    # ---- compilation -------------------------------------------------------------------------

    def warm_up_one(self) -> bool:
        if self._to_compile:
            self.runner.compiled.get(self._to_compile.pop(0))
            return True
        missing = [s for s in self.runner.shapes.seq_buckets if s not in self._samplers]
        if not missing:
            return False
        self._sampler(missing[0])
        return True

    def _sampler(self, s: int) -> Any:
        """The compiled `draft_sample_step` for S bucket `s`."""
        if s not in self._samplers:
            info = self.runner.compiled.get(self._first_forward(s)).out_info[0].logits
            vocab = info.shape[-1]

            replicated = None if self.runner.plan is None else self.runner.plan.replicated

            def like(x: Any) -> jax.ShapeDtypeStruct:  # a host input, as `runner.put` places it
                return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=replicated)

            sample = jitted_draft_sample
            if replicated is not None:  # drafts, probs and the fed tokens stay replicated
                sample = jax.jit(
                    draft_sample_step,
                    static_argnames=("num_fed",),
                    donate_argnames=("drafts", "probs"),
                    out_shardings=replicated,
                )
            self._samplers[s] = sample.lower(
                info,
                jax.tree.map(like, sampling_tensors([], s, 0)),
                like(np.int32(0)),
                like(np.zeros((s, self.k), np.int32)),
                jax.ShapeDtypeStruct((s, self.k, vocab), np.float32, sharding=replicated),
                num_fed=pick_bucket(s, self.runner.shapes.token_buckets),
            ).compile()
        return self._samplers[s]

    def _first_forward(self, s: int) -> Variant:
        t = next(t for t, seqs in self.runner.shapes.all_pairs() if seqs == s)
        return Variant("forward", tokens=t, seqs=s)

    # ---- steps -------------------------------------------------------------------------------

    def follow(self, out: SchedulerOutput, kv: KVCacheManager) -> None:
        self._forward_known(out, kv)

    def propose(self, out: SchedulerOutput, rooms: list[int], kv: KVCacheManager) -> Proposals:
        logits, batch = self._forward_known(out, kv)
        s = batch.kv_lens.shape[0]
        sample = self._sampler(s)
        vocab = self.runner.cfg.vocab_size
        t, drafts, probs = self.runner.put(
            (
                batch.sampling,
                np.zeros((s, self.k), np.int32),
                np.zeros((s, self.k, vocab), np.float32),
            )
        )
        known = np.zeros(s, np.int64)
        known[: len(out.scheduled)] = [x.num_known_tokens for x in out.scheduled]
        room = np.zeros(s, np.int64)
        room[: len(rooms)] = rooms
        for j in range(self.k):
            drafts, probs, fed = sample(logits, t, self.runner.put(np.int32(j)), drafts, probs)
            logits = self._forward_one(fed, batch, known, room, j + 1)
        host = np.asarray(drafts)  # i32[S, K]
        return Proposals([host[i, :r].tolist() for i, r in enumerate(rooms)], probs)

    def _forward_known(self, out: SchedulerOutput, kv: KVCacheManager) -> tuple[Any, StepInput]:
        """The draft's forward over the step's known tokens; its logits at each sequence's
        last one, f32[S, V], and the (host) batch."""
        runner = self.runner
        batch = runner.builder.build(out, kv, penalties=False)
        t, s = batch.token_ids.shape[0], batch.kv_lens.shape[0]
        forward = runner.compiled.get(Variant("forward", tokens=t, seqs=s))
        placed = runner.put(dataclasses.replace(batch, token_bitmask=None))
        result, runner.kv_caches = forward(
            runner.params, runner.kv_caches, placed.token_ids, placed.positions,
            attention_metadata(placed), placed.logits_indices, None, runner.host_tokens_only(t),
        )  # fmt: skip
        return result.logits, batch

    def _forward_one(
        self,
        fed: jax.Array,  # i32[T]: each sequence's proposal j, padded to the token bucket
        batch: StepInput,
        known: np.ndarray,  # i[S]: each sequence's known tokens
        room: np.ndarray,  # i[S]: proposals it may make
        j: int,
    ) -> Any:
        """Feeds proposal j of each sequence at position known + j - 1 (sequences without
        room for it write nothing); returns the logits there, f32[S, V]."""
        runner = self.runner
        s = len(known)
        t = pick_bucket(s, runner.shapes.token_buckets)
        page_size = runner.page_size
        valid = room >= j
        positions = np.where(valid, known + j - 1, 0).astype(np.int32)
        table = np.asarray(batch.page_table)
        pages = table[np.arange(s), positions // page_size]
        slots = np.where(valid, pages * page_size + positions % page_size, -1)
        meta = AttentionMetadata(
            slot_mapping=_pad(slots, t, -1),
            kv_lens=np.where(valid, positions + 1, 1).astype(np.int32),
            page_table=table,
            cu_q_lens=np.arange(s + 1, dtype=np.int32),
            num_seqs=np.int32(s),
        )
        forward = runner.compiled.get(Variant("forward", tokens=t, seqs=s))
        placed, meta, rows = runner.put((_pad(positions, t, 0), meta, np.arange(s, dtype=np.int32)))
        result, runner.kv_caches = forward(
            runner.params, runner.kv_caches, fed, placed, meta, rows, None,
            runner.host_tokens_only(t),
        )  # fmt: skip
        return result.logits


def _pad(x: np.ndarray, length: int, value: int) -> np.ndarray:
    out = np.full(length, value, np.int32)
    out[: len(x)] = x
    return out


__all__ = ["DraftModelProposer", "NgramProposer", "Proposals", "Proposer", "draft_sample"]
