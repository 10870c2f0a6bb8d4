"""Owns the device side of the engine: parameters, KV pages, and the compiled step (its variants
in `engine.compiled_step`, all compiled at warm-up).

Boundary code: the only place (with the loaders) that moves arrays between host and device.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh
from tqdm import tqdm

from engine import compilation, host_memory, kv_cache
from engine.batch import BatchBuilder, BatchShapes, no_bias
from engine.compiled_step import CompiledStep, Variant
from engine.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig
from engine.errors import XlaserveError
from engine.lora_slots import LoRASlots
from engine.models.layers import Params, stack_layers
from engine.models.lora import LoRAInputs
from engine.models.quant import QUANTIZED_AXIS, QuantizedWeight
from engine.request import MAX_LOGPROBS
from engine.sampling import bitmask_words
from engine.scheduler import SchedulerOutput
from engine.step import StepInput, StepOptions, StepOutput, TokenCarry, attention_metadata
from pallas_kernels import cpu
from pallas_kernels.kv_cache_update import KVCacheSpec, init_kv_pages
from sharding.layout import ShardingLayout
from sharding.multihost import put_replicated
from sharding.rules import ShardingPlan

log = logging.getLogger(__name__)

# Writes the constrained rows of a batch's token bitmask, i32[S, W], in place.
FillBitmask = Callable[[np.ndarray], None]


def _platform() -> str:
    return jax.devices()[0].platform


def _stacks_layers(cfg: ModelConfig, params: Params) -> bool:
    """Whether one device's layers are stacked on a leading axis and still run unrolled
    (`layers.run_layers`): on CPU, where every linear weight of a layer is quantized and the C++
    kernels read each layer's weight from its stack in place. A step then passes XLA one array
    per kind of weight, not one per layer (SmolLM2 int4: 733 arrays -> 66), and jit's dispatch
    of every array costs the host ~2 us (bench/RESULTS.md). Float weights stay per layer (XLA's
    products would copy a slice out of a stack), as does a mixture of experts (its experts are
    gathered, not read in place)."""
    layers = params["layers"]
    if not isinstance(layers, list) or cfg.num_experts or _platform() != "cpu":
        return False
    linear = [w for name, w in layers[0].items() if name in QUANTIZED_AXIS]
    return bool(linear) and all(isinstance(w, QuantizedWeight) for w in linear) and cpu.available()


CPU_DEFAULT_KV_BYTES = 2 << 30  # like vLLM's CPU backend: a fixed space, not a RAM fraction


def _kv_budget_bytes(cache: CacheConfig) -> int:
    """The KV cache's memory: as configured, else a fraction of the accelerator's free memory
    (after the weights, which are already placed), else a fixed default on CPU."""
    if cache.memory_bytes is not None:
        return cache.memory_bytes
    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        free = int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
        return int(free * cache.memory_fraction)
    return CPU_DEFAULT_KV_BYTES


def num_pages_for(cache: CacheConfig, page_bytes: int) -> int:
    if cache.num_pages is not None:
        return cache.num_pages
    try:
        return kv_cache.pages_for_memory(_kv_budget_bytes(cache), page_bytes)
    except ValueError as e:
        raise XlaserveError(str(e)) from e


def _sharding_plan(
    cfg: ModelConfig, mesh: Mesh | None, layout: ShardingLayout | None, expert_dispatch: str
) -> ShardingPlan | None:
    if mesh is None and layout is None:
        return None
    if mesh is None or layout is None:
        raise XlaserveError("a device mesh and its sharding layout go together")
    return ShardingPlan.create(mesh, cfg, layout, expert_dispatch=expert_dispatch)


def _check_expert_counts(count: bool, cfg: ModelConfig, plan: ShardingPlan | None) -> bool:
    if count and not cfg.num_experts:
        raise XlaserveError("--expert-token-counts needs a mixture-of-experts model")
    if count and plan is not None and plan.num_stages > 1:
        raise XlaserveError("--expert-token-counts is not supported with pipeline parallelism")
    return count


class ModelRunner:
    """Runs scheduled batches through the compiled step and returns sampled tokens (NumPy).

    With a `mesh` and its sharding `layout`, parameters and KV pages are sharded as the
    layout says (`sharding.rules`) and the step is compiled for the mesh.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        params: Params,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        *,
        attention_impl: str | None = None,
        eos_token_ids: tuple[int, ...] = (),
        mesh: Mesh | None = None,
        layout: ShardingLayout | None = None,
        lora_config: LoRAConfig | None = None,
        count_expert_tokens: bool = False,
        expert_dispatch: str = "allgather",
    ):
        """`count_expert_tokens`: each step also returns a mixture of experts' tokens per
        layer and expert (StepOutput.expert_counts), a metric of load balance.
        `expert_dispatch`: how they reach the devices of the expert axis (sharding/experts.py)."""
        compilation.install()
        if _platform() == "cpu":
            host_memory.keep_freed_memory()
        self.cfg = cfg
        self.plan = _sharding_plan(cfg, mesh, layout, expert_dispatch)
        self.count_expert_tokens = _check_expert_counts(count_expert_tokens, cfg, self.plan)
        self.params = self._place_params(params)
        # The adapters' device slots (engine/lora_slots.py); None: LoRA is off.
        self.lora = None
        if lora_config is not None:
            self.lora = LoRASlots(lora_config, cfg, self.params, self.plan)
        self.attention_impl = attention_impl
        self.kv_dtype = cache_config.kv_dtype(cfg.dtype, _platform())
        if self.plan is not None and self.kv_dtype in ("int8", "fp8"):
            raise XlaserveError(
                f"--kv-cache-dtype {self.kv_dtype} is not supported with tensor or pipeline "
                "parallelism yet; use float32 or bfloat16"
            )
        one_page = self._kv_spec(num_pages=1, page_size=cache_config.page_size)
        # One page of every layer, as one device holds it (its share of heads and layers).
        shards = 1 if self.plan is None else self.plan.cache_shards
        page_bytes = one_page.nbytes * cfg.num_layers // shards
        self.num_pages = num_pages_for(cache_config, page_bytes)
        self.kv_spec = one_page.replace(num_pages=self.num_pages)
        self.kv_caches = self._init_caches()
        if _platform() == "cpu":
            huge = host_memory.use_huge_pages(jax.tree.leaves((self.params, self.kv_caches)))
            log.info("weights and KV cache: %.1f GiB on huge pages", huge / 2**30)
        self.page_size = cache_config.page_size
        self.page_bytes = page_bytes
        self.shapes = BatchShapes.create(
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
            max_num_seqs=scheduler_config.max_num_seqs,
            max_model_len=scheduler_config.model_len,
            page_size=cache_config.page_size,
            vocab_size=cfg.vocab_size,
        )
        self.builder = BatchBuilder(self.shapes, cache_config.page_size, eos_token_ids)
        self.compiled = CompiledStep(
            self.options(), self.shapes, self.page_size, self.params, self.kv_caches,
            None if self.lora is None else self.lora.weights,
        )  # fmt: skip
        # i32[C]: the last step's sampled tokens, on the device, for the next step's inputs.
        self._carry = self.put(self.compiled.empty_carry())
        # S -> `batch.no_bias(S)` on the device: a batch without a logit bias (most) does not
        # send its two largest inputs again each step.
        self._no_bias: dict[int, tuple[jax.Array, jax.Array]] = {}
        self._no_constraint: dict[int, jax.Array] = {}  # S -> `_all_allowed(S)`
        # Called with each batch before it runs (a multi-process leader sends it to followers).
        self.before_step: Callable[[StepInput, StepOptions], None] | None = None
        # Read by the serving side: how long warm-up took, and the process's XLA compilation
        # count when it ended (None until every variant is compiled).
        self.warm_up_seconds: float | None = None
        self.compilations_at_warm_up: int | None = None
        self._idle_compile_seconds = 0.0

    def _kv_spec(self, *, num_pages: int, page_size: int) -> KVCacheSpec:
        return KVCacheSpec.for_platform(
            _platform(),
            num_pages=num_pages,
            page_size=page_size,
            num_kv_heads=self.cfg.num_kv_heads if self.plan is None else self.plan.cache_kv_heads,
            head_dim=self.cfg.head_dim,
            dtype=self.kv_dtype,
        )

    def _place_params(self, params: Params) -> Params:
        """Sharded by the plan (layers stacked for a pipeline). Without a mesh as given, but
        with quantized layers stacked where the CPU kernels take them (`_stacks_layers`)."""
        if self.plan is None:
            if _stacks_layers(self.cfg, params):
                params = {**params, "layers": stack_layers(params["layers"])}
            return params
        if self.plan.num_stages > 1 and isinstance(params["layers"], list):
            params = {**params, "layers": stack_layers(params["layers"])}
        return jax.device_put(params, self.plan.param_shardings(params))

    def _init_caches(self) -> Any:
        """One cache array per layer: a list (unrolled layers, `layers.run_layers`), or stacked
        for a pipeline's scan; with a mesh, allocated already sharded."""
        if self.plan is not None:
            return self._init_sharded_caches(self.plan)
        return [init_kv_pages(self.kv_spec) for _ in range(self.cfg.num_layers)]

    def _init_sharded_caches(self, plan: ShardingPlan) -> Any:
        stacked = not isinstance(self.params["layers"], list)
        shape = ((self.cfg.num_layers,) if stacked else ()) + self.kv_spec.shape
        dtype = (
            np.dtype(self.kv_spec.dtype) if self.kv_spec.dtype != "bfloat16" else jax.numpy.bfloat16
        )
        zeros = jax.jit(
            lambda: jax.numpy.zeros(shape, dtype), out_shardings=plan.cache_sharding(shape)
        )
        return zeros() if stacked else [zeros() for _ in range(self.cfg.num_layers)]

    # ---- compilation ---------------------------------------------------------------------

    def options(
        self,
        *,
        penalties: bool = False,
        logprobs: bool = False,
        prompt_logprobs: bool = False,
    ) -> StepOptions:
        """What a batch's requests ask of the step. Logprob counts are rounded up to
        MAX_LOGPROBS: the step always has room for the most any request may ask."""
        return StepOptions(
            self.cfg,
            self.attention_impl,
            apply_penalties=penalties,
            num_top_logprobs=MAX_LOGPROBS if logprobs else 0,
            num_prompt_logprobs=MAX_LOGPROBS if prompt_logprobs else None,
            sharding=self.plan,
            count_expert_tokens=self.count_expert_tokens,
        )

    def warm_up(self, *, progress: bool = True) -> float:
        """Compiles every variant of the step; returns the seconds it took."""
        start = time.perf_counter()
        variants = self.compiled.variants()
        for variant in tqdm(variants, desc="compiling", unit="variant", disable=not progress):
            self.compiled.get(variant)
        seconds = time.perf_counter() - start
        self._warmed_up(seconds)
        return seconds

    def warm_up_one(self) -> bool:
        """Compiles one variant not compiled yet; False when every one is. A server calls this
        while idle, so that it answers before all are done."""
        variant = self.compiled.missing()
        if variant is None:
            self._warmed_up(0.0)
            return False
        start = time.perf_counter()
        self.compiled.get(variant)
        self._idle_compile_seconds += time.perf_counter() - start
        return True

    def _warmed_up(self, seconds: float) -> None:
        if self.compilations_at_warm_up is None:
            self.warm_up_seconds = seconds + self._idle_compile_seconds
            self.compilations_at_warm_up = compilation.count()

    @property
    def compilations_after_warm_up(self) -> int:
        """XLA compilations in this process since warm-up ended (0 before it ends)."""
        if self.compilations_at_warm_up is None:
            return 0
        return compilation.count() - self.compilations_at_warm_up

    @property
    def num_compiled(self) -> int:
        return self.compiled.num_compiled

    # ---- execution -------------------------------------------------------------------------

    def host_tokens_only(self, num_tokens: int) -> TokenCarry:
        """A forward's carry that supplies none of its `num_tokens` tokens (all from the host):
        for callers that run the compiled forward themselves (a draft model)."""
        return TokenCarry(self._carry, self.put(np.full(num_tokens, -1, np.int32)))

    def dispatch(
        self,
        out: SchedulerOutput,
        kv_manager: kv_cache.KVCacheManager,
        options: StepOptions,
        fill_bitmask: FillBitmask | None = None,
    ) -> StepOutput:
        """Starts one step and returns at once; its outputs are device arrays still being
        computed (`fetch` waits for them), so the host can work in the meantime."""
        batch = self.builder.build(
            out, kv_manager, penalties=options.apply_penalties, constrained=fill_bitmask is not None
        )
        return self.run_batch(batch, options, fill_bitmask)

    def run_batch(
        self, batch: StepInput, options: StepOptions, fill_bitmask: FillBitmask | None = None
    ) -> StepOutput:
        """Starts the step on a built (NumPy) batch: the forward, the sampling tail, and prompt
        logprobs when `options` ask for them.

        `fill_bitmask` writes the constrained rows of the batch's token bitmask (structured
        output). It runs after the forward is dispatched, so the host computes the masks while
        the device computes the logits; only the sampling tail waits for them. (With followers
        it runs first: they are sent the whole batch.) A batch without a bitmask (no row is
        constrained: most) samples with the device's all-ones mask of its S bucket."""
        t, s = batch.token_ids.shape[0], batch.kv_lens.shape[0]
        forward = self.compiled.get(Variant("forward", tokens=t, seqs=s))
        sample = self.compiled.get(Variant("sample", seqs=s, penalties=options.apply_penalties))
        wants_prompt = options.num_prompt_logprobs is not None
        prompt = self.compiled.get(Variant("prompt_logprobs", tokens=t)) if wants_prompt else None
        if self.before_step is not None:
            if fill_bitmask is not None:
                fill_bitmask(batch.token_bitmask)
                fill_bitmask = None
            self.before_step(batch, options)
        host = dataclasses.replace(batch, token_bitmask=None)  # sent once it is filled
        placed, want_logprobs = self._inputs((host, np.bool_(options.num_top_logprobs > 0)))
        placed = self._bias_on_device(placed, s)
        lora = None if self.lora is None else LoRAInputs(self.lora.weights, placed.lora_slots)
        carry = TokenCarry(self._carry, placed.token_src)
        out, self.kv_caches = forward(
            self.params, self.kv_caches, placed.token_ids, placed.positions,
            attention_metadata(placed), placed.logits_indices, lora, carry,
        )  # fmt: skip
        if fill_bitmask is not None:
            fill_bitmask(batch.token_bitmask)
        if batch.token_bitmask is None:
            bitmask = self._all_allowed(s)
        else:
            bitmask = self._inputs(batch.token_bitmask)
        sampled, self._carry = sample(out.logits, placed.sampling, want_logprobs, bitmask)
        prompt_out = None
        if prompt is not None:
            prompt_out = prompt(self.params, out.hidden, placed.next_token_ids)
        return StepOutput(
            sampled.token_ids, sampled.logprobs, sampled.top_ids, sampled.top_logprobs,
            prompt_out, out.expert_counts,
        )  # fmt: skip

    def _all_allowed(self, s: int) -> jax.Array:
        """i32[S, W] on the device, every bit set: the token bitmask of a batch in which no
        row is constrained, sent once per S bucket rather than every step (S x V / 32 words: 1.5
        MiB at S = 256 for a 49,152-token vocabulary)."""
        if s not in self._no_constraint:
            words = bitmask_words(self.cfg.vocab_size)
            self._no_constraint[s] = self.put(np.full((s, words), -1, np.int32))
        return self._no_constraint[s]

    def _bias_on_device(self, batch: StepInput, s: int) -> StepInput:
        """`batch` with the device's copy of the shared no-bias arrays, if it has them."""
        if batch.sampling.bias_ids is not no_bias(s)[0]:
            return batch
        if s not in self._no_bias:
            self._no_bias[s] = self.put(no_bias(s))
        ids, values = self._no_bias[s]
        sampling = dataclasses.replace(batch.sampling, bias_ids=ids, bias_values=values)
        return dataclasses.replace(batch, sampling=sampling)

    def _inputs(self, tree: Any) -> Any:
        """A step's host inputs as the compiled parts take them: on one device the NumPy arrays
        themselves (each executable moves its own arguments, at a fraction of the cost of
        `jax.device_put` per array; each input goes to one part), over a mesh placed
        replicated."""
        return tree if self.plan is None else self.put(tree)

    def put(self, tree: Any) -> Any:
        """Host arrays -> the device, or replicated over the runner's mesh."""
        if self.plan is None:
            return jax.device_put(tree)
        return put_replicated(tree, self.plan.replicated)

    @staticmethod
    def fetch(result: StepOutput) -> StepOutput:
        """The step's outputs in NumPy (rows past the batch are padding)."""
        return jax.tree.map(np.asarray, result)

    def execute(
        self, out: SchedulerOutput, kv_manager: kv_cache.KVCacheManager, options: StepOptions
    ) -> StepOutput:
        return self.fetch(self.dispatch(out, kv_manager, options))
