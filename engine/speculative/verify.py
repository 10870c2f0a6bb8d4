"""The verification step of speculative decoding: the same ragged forward as any step, with
logits at every proposed position (K + 1 per sequence), then rejection sampling
(engine/speculative/rejection.py) instead of the plain sampling tail.

Its parts are compiled beside the plain step's, for the sequence buckets where speculation
runs (up to `disable_by_batch_size`): a forward per (T, S) bucket whose logits indices are
i32[S * (K + 1)], and a verification tail per S bucket, with and without penalties. A step
whose sequences propose nothing runs the plain step, so it costs what it costs without
speculation. Prompt logprobs reuse the plain step's part (it only reads hidden states).

Boundary code: builds the batch in NumPy and moves it to the device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from engine.batch import pick_bucket, sampling_tensors
from engine.compiled_step import CompiledStep, Variant
from engine.config import SpeculativeConfig
from engine.kv_cache import KVCacheManager
from engine.model_runner import FillBitmask, ModelRunner
from engine.models.lora import LoRAInputs
from engine.request import MAX_LOGPROBS
from engine.sampling import SamplerOutput, bitmask_words
from engine.scheduler import SchedulerOutput
from engine.speculative.rejection import VerifyOutput, jitted_verify
from engine.step import StepOptions, attention_metadata


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class VerifyResult:
    """A verification step's outputs: the emitted runs, and prompt logprobs when asked."""

    runs: VerifyOutput
    prompt: SamplerOutput | None = None


class VerifyCompiledStep(CompiledStep):
    """The verification parts of the step (module docstring), compiled like the plain ones."""

    def __init__(self, runner: ModelRunner, k: int, max_seqs: int, *, with_probs: bool):
        seqs = runner.shapes.seq_buckets
        largest = pick_bucket(min(max_seqs, seqs[-1]), seqs)
        shapes = dataclasses.replace(
            runner.shapes, seq_buckets=tuple(s for s in seqs if s <= largest)
        )
        lora = None if runner.lora is None else runner.lora.weights
        super().__init__(
            runner.compiled.options, shapes, runner.page_size, runner.params, runner.kv_caches, lora
        )
        self.k = k
        self.with_probs = with_probs  # the draft's distributions come with its proposals

    def variants(self) -> list[Variant]:
        forward = [Variant("forward", tokens=t, seqs=s) for t, s in self.shapes.all_pairs()]
        verify = [
            Variant("sample", seqs=s, penalties=p)
            for p in (False, True)
            for s in self.shapes.seq_buckets
        ]
        return forward + verify

    def _lower_forward(self, t: int, s: int) -> Any:
        empty = self._examples.build_padded(SchedulerOutput(), None, t, s, penalties=False)
        batch = jax.tree.map(self._like, empty)
        indices = self._like(np.zeros(s * (self.k + 1), np.int32))
        lora = None if self._lora is None else LoRAInputs(self._lora, batch.lora_slots)
        return self._jits[0].lower(
            self._params, self._kv, batch.token_ids, batch.positions, attention_metadata(batch),
            indices, lora, options=self.options,
        )  # fmt: skip

    def _lower_sample(self, s: int, penalties: bool) -> Any:
        penalty_len = self.shapes.penalty_len if penalties else 0
        vocab = self.options.cfg.vocab_size
        bitmask = np.zeros((s * (self.k + 1), bitmask_words(vocab)), np.int32)
        probs = None
        if self.with_probs:
            probs = jax.ShapeDtypeStruct((s, self.k, vocab), np.float32, sharding=self._replicated)
        return jitted_verify.lower(
            self._forward_info(seqs=s).logits,
            jax.tree.map(self._like, sampling_tensors([], s, penalty_len)),
            self._like(np.zeros((s, self.k), np.int32)),
            self._like(np.zeros(s, np.int32)),
            self._like(np.bool_(True)),
            self._like(bitmask),
            probs,
            apply_penalties=penalties,
            num_top_logprobs=MAX_LOGPROBS,
        )


def draft_arrays(out: SchedulerOutput, s: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each scheduled sequence's proposals, i32[S, K] (0-padded), and their count, i32[S]."""
    drafts = np.zeros((s, k), np.int32)
    counts = np.zeros(s, np.int32)
    for i, scheduled in enumerate(out.scheduled):
        proposed = scheduled.draft_token_ids
        drafts[i, : len(proposed)] = proposed
        counts[i] = len(proposed)
    return drafts, counts


def verify_indices(cu_q_lens: np.ndarray, num_drafts: np.ndarray, k: int) -> np.ndarray:
    """i32[S * (K + 1)]: for each sequence, its last known token then its proposals (the last
    token repeated past them): the positions whose logits score the proposals."""
    last = np.maximum(cu_q_lens[1:] - 1, 0)  # i32[S]
    first = np.maximum(last - num_drafts, 0)
    indices = np.minimum(first[:, None] + np.arange(k + 1), last[:, None])
    return indices.reshape(-1).astype(np.int32)


class Verifier:
    """Runs verification steps on a model runner's parameters and KV cache."""

    def __init__(self, runner: ModelRunner, config: SpeculativeConfig):
        self.runner = runner
        self.k = config.num_speculative_tokens
        self.compiled = VerifyCompiledStep(
            runner, self.k, config.disable_by_batch_size, with_probs=config.method != "ngram"
        )

    @property
    def max_seqs(self) -> int:
        """The most sequences a verification step can hold (its largest bucket)."""
        return self.compiled.shapes.seq_buckets[-1]

    def warm_up(self) -> None:
        for variant in self.compiled.variants():
            self.compiled.get(variant)

    def warm_up_one(self) -> bool:
        variant = self.compiled.missing()
        if variant is None:
            return False
        self.compiled.get(variant)
        return True

    def dispatch(
        self,
        out: SchedulerOutput,
        kv_manager: KVCacheManager,
        options: StepOptions,
        fill_bitmask: FillBitmask | None = None,  # writes i32[S * (K + 1), W]
        draft_probs: jax.Array | None = None,  # f32[S, K, V]; None: one-hot (n-gram)
    ) -> VerifyResult:
        """Starts a verification step and returns at once (device arrays still computing)."""
        runner = self.runner
        batch = runner.builder.build(out, kv_manager, penalties=options.apply_penalties)
        t, s = batch.token_ids.shape[0], batch.kv_lens.shape[0]
        drafts, counts = draft_arrays(out, s, self.k)
        indices = verify_indices(np.asarray(batch.cu_q_lens), counts, self.k)
        forward = self.compiled.get(Variant("forward", tokens=t, seqs=s))
        verify = self.compiled.get(Variant("sample", seqs=s, penalties=options.apply_penalties))
        host = dataclasses.replace(batch, token_bitmask=None)
        want = np.bool_(options.num_top_logprobs > 0)
        placed, indices, drafts, counts, want = runner.put((host, indices, drafts, counts, want))
        lora = None if runner.lora is None else LoRAInputs(runner.lora.weights, placed.lora_slots)
        hidden_logits, runner.kv_caches = forward(
            runner.params, runner.kv_caches, placed.token_ids, placed.positions,
            attention_metadata(placed), indices, lora,
        )  # fmt: skip
        words = bitmask_words(self.compiled.options.cfg.vocab_size)
        host_mask = np.full((s * (self.k + 1), words), -1, np.int32)  # a mask per position
        if fill_bitmask is not None:
            fill_bitmask(host_mask)
        bitmask = runner.put(host_mask)
        runs = verify(
            hidden_logits.logits, placed.sampling, drafts, counts, want, bitmask, draft_probs
        )
        prompt = None
        if options.num_prompt_logprobs is not None:
            part = runner.compiled.get(Variant("prompt_logprobs", tokens=t))
            prompt = part(runner.params, hidden_logits.hidden, placed.next_token_ids)
        return VerifyResult(runs, prompt)

    @staticmethod
    def fetch(result: VerifyResult) -> VerifyResult:
        return jax.tree.map(np.asarray, result)
