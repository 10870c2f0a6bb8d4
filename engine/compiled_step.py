"""The compiled parts of one engine's step (`engine.step`): which variants there are, how each
is lowered, and their executables. Warm-up compiles every variant, so that no request mix
compiles anything later: a forward per (T, S) bucket, a sampling tail per S bucket with and
without penalties (logprobs are a runtime branch inside it), and prompt logprobs per T bucket.

Boundary code: lowers against abstract arrays (shapes, dtypes, shardings); runs nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

import jax
import numpy as np

from engine.batch import BatchBuilder, BatchShapes, sampling_tensors
from engine.models.layers import Params
from engine.models.lora import LoRAInputs
from engine.request import MAX_LOGPROBS
from engine.sampling import bitmask_words
from engine.scheduler import SchedulerOutput
from engine.step import (
    ForwardOutput,
    StepOptions,
    TokenCarry,
    attention_metadata,
    forward_step,
    jitted_forward,
    jitted_prompt_logprobs,
    jitted_sample_carry,
    prompt_logprobs_step,
    sample_carry_step,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Variant:
    """One compiled part of the step: the forward of a (T, S) bucket, the sampling tail of an S
    bucket (with or without penalties), or prompt logprobs over a T bucket."""

    kind: Literal["forward", "sample", "prompt_logprobs"]
    tokens: int = 0  # T: forward, prompt_logprobs
    seqs: int = 0  # S: forward, sample
    penalties: bool = False  # sample


class CompiledStep:
    """The executables of one engine's step, compiled on first request (`get`) or ahead of
    it, in `variants` order, by warm-up."""

    def __init__(
        self,
        options: StepOptions,
        shapes: BatchShapes,
        page_size: int,
        params: Params,
        kv: Any,
        lora: Any = None,
    ):
        """`options`: the forward's (no sampling feature: those are variants of the tail);
        `params`, `kv` (the KV caches) and `lora` (the adapters' slots, or None) as placed, for
        their shapes and shardings."""
        self.options, self.shapes = options, shapes
        plan = options.sharding
        self._replicated = None if plan is None else plan.replicated
        self._params = jax.tree.map(lambda x: self._like(x, keep_sharding=True), params)
        self._kv = jax.tree.map(lambda x: self._like(x, keep_sharding=True), kv)
        self._lora = jax.tree.map(lambda x: self._like(x, keep_sharding=True), lora)
        # The all-padding batches that lowering uses have buffers of their own: a variant
        # compiled on first use must not overwrite the batch that is about to run.
        self._examples = BatchBuilder(shapes, page_size)
        self._jits = self._jit(kv) if plan is not None else (
            jitted_forward, jitted_sample_carry, jitted_prompt_logprobs
        )  # fmt: skip
        self._compiled: dict[Variant, Any] = {}

    def _jit(self, kv: Any) -> tuple[Any, Any, Any]:
        """The three parts jitted for the mesh: logits stay sharded over the vocabulary as the
        output layer leaves them; what the host reads comes back replicated."""
        plan = self.options.sharding
        assert plan is not None
        caches = jax.tree.map(lambda x: x.sharding, kv)
        logits = plan.sharding((None, "vocab"), (1, self.options.cfg.vocab_size))
        counts = plan.replicated if self.options.count_expert_tokens else None
        forward = jax.jit(
            forward_step,
            static_argnames=("options",),
            donate_argnames=("kv_caches",),
            out_shardings=(ForwardOutput(logits, plan.replicated, counts), caches),
        )
        sample = jax.jit(
            sample_carry_step,
            static_argnames=("apply_penalties", "num_top_logprobs", "carry_width"),
            out_shardings=plan.replicated,
        )
        prompt = jax.jit(
            prompt_logprobs_step, static_argnames=("cfg", "num_top"), out_shardings=plan.replicated
        )
        return forward, sample, prompt

    def variants(self) -> list[Variant]:
        """Everything warm-up compiles: the plain path first (each forward with the sampling
        tail of its S bucket, smallest first), then penalties and prompt logprobs."""
        plain: list[Variant] = []
        for t, s in self.shapes.all_pairs():
            plain.append(Variant("forward", tokens=t, seqs=s))
            if Variant("sample", seqs=s) not in plain:
                plain.append(Variant("sample", seqs=s))
        penalties = [Variant("sample", seqs=s, penalties=True) for s in self.shapes.seq_buckets]
        prompt = [Variant("prompt_logprobs", tokens=t) for t in self.shapes.token_buckets]
        return plain + penalties + prompt

    def missing(self) -> Variant | None:
        """The first variant not compiled yet."""
        return next((v for v in self.variants() if v not in self._compiled), None)

    @property
    def num_compiled(self) -> int:
        return len(self._compiled)

    def get(self, variant: Variant) -> Any:
        """The variant's executable, compiled now if it is not yet."""
        if variant not in self._compiled:
            self._compiled[variant] = self._lower(variant).compile()
            log.debug("compiled %s", variant)
        return self._compiled[variant]

    # ---- lowering ----------------------------------------------------------------------------

    def _lower(self, variant: Variant) -> Any:
        if variant.kind == "forward":
            return self._lower_forward(variant.tokens, variant.seqs)
        if variant.kind == "sample":
            return self._lower_sample(variant.seqs, variant.penalties)
        return self._lower_prompt_logprobs(variant.tokens)

    def _lower_forward(self, t: int, s: int) -> Any:
        empty = self._examples.build_padded(SchedulerOutput(), None, t, s, penalties=False)
        batch = jax.tree.map(self._like, empty)
        lora = None if self._lora is None else LoRAInputs(self._lora, batch.lora_slots)
        carry = TokenCarry(self._like(self.empty_carry()), batch.token_src)
        return self._jits[0].lower(
            self._params, self._kv, batch.token_ids, batch.positions, attention_metadata(batch),
            batch.logits_indices, lora, carry, options=self.options,
        )  # fmt: skip

    def empty_carry(self) -> np.ndarray:
        """i32[C]: the sampled tokens of a step that carries none (before the first step)."""
        return np.zeros(self.shapes.seq_buckets[-1], np.int32)

    def _lower_sample(self, s: int, penalties: bool) -> Any:
        penalty_len = self.shapes.penalty_len if penalties else 0
        bitmask = np.zeros((s, bitmask_words(self.options.cfg.vocab_size)), np.int32)
        return self._jits[1].lower(
            self._forward_info(seqs=s).logits,
            jax.tree.map(self._like, sampling_tensors([], s, penalty_len)),
            self._like(np.bool_(True)),
            self._like(bitmask),
            apply_penalties=penalties,
            num_top_logprobs=MAX_LOGPROBS,
            carry_width=self.shapes.seq_buckets[-1],
        )

    def _lower_prompt_logprobs(self, t: int) -> Any:
        return self._jits[2].lower(
            self._params,
            self._forward_info(tokens=t).hidden,
            self._like(np.zeros(t, np.int32)),
            cfg=self.options.cfg,
            num_top=MAX_LOGPROBS,
        )

    def _forward_info(self, *, tokens: int | None = None, seqs: int | None = None) -> ForwardOutput:
        """The shapes, dtypes and shardings of the outputs of a forward with `tokens` tokens or
        `seqs` sequences, which the other parts are compiled for: of one already compiled, else
        of the smallest such bucket (compiled now)."""
        pairs = [
            p for p in self.shapes.all_pairs() if tokens in (None, p[0]) and seqs in (None, p[1])
        ]
        compiled = [p for p in pairs if Variant("forward", *p) in self._compiled]
        t, s = (compiled or pairs)[0]
        info = self.get(Variant("forward", tokens=t, seqs=s)).out_info[0]
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), info
        )

    def _like(self, x: Any, *, keep_sharding: bool = False) -> jax.ShapeDtypeStruct:
        """An abstract array like `x`: placed as `x` is (parameters and caches), or replicated
        over the mesh (host inputs); on one device, wherever jit puts it."""
        sharding: jax.sharding.Sharding | None = self._replicated
        if keep_sharding and isinstance(x, jax.Array) and sharding is not None:
            sharding = x.sharding
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)
