"""Owns the device side of the engine: parameters, KV pages, and one compiled step per bucket.

Boundary code: the only place (with the loaders) that moves arrays between host and device.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from engine import compilation, kv_cache
from engine.batch import BatchBuilder, BatchShapes
from engine.config import CacheConfig, ModelConfig, SchedulerConfig
from engine.errors import XlaserveError
from engine.models.layers import Params
from engine.scheduler import SchedulerOutput
from engine.step import StepInput, StepOptions, StepOutput, jitted_step
from pallas_kernels.kv_cache_update import KVCacheSpec, init_kv_pages

log = logging.getLogger(__name__)


def _platform() -> str:
    return jax.devices()[0].platform


def _free_memory_bytes() -> int:
    """Memory the KV cache may draw on: the device's free memory, or host RAM on CPU."""
    stats = jax.devices()[0].memory_stats() if _platform() != "cpu" else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def num_pages_for(cfg: ModelConfig, cache: CacheConfig, spec_page_bytes: int) -> int:
    if cache.num_pages is not None:
        return cache.num_pages
    budget = cache.memory_bytes
    if budget is None:
        budget = int(_free_memory_bytes() * cache.memory_fraction)
    try:
        return kv_cache.pages_for_memory(budget, spec_page_bytes)
    except ValueError as e:
        raise XlaserveError(str(e)) from e


class ModelRunner:
    """Runs scheduled batches through the compiled step and returns sampled tokens (NumPy)."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: Params,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        *,
        attention_impl: str | None = None,
    ):
        compilation.install()
        self.cfg = cfg
        self.params = params
        self.attention_impl = attention_impl
        one_page = self._kv_spec(num_pages=1, page_size=cache_config.page_size)
        page_bytes = int(np.prod(one_page.shape)) * np.dtype(cfg.dtype).itemsize * cfg.num_layers
        self.num_pages = num_pages_for(cfg, cache_config, page_bytes)
        self.kv_spec = one_page.replace(num_pages=self.num_pages)
        self.kv_caches = self._init_caches()
        self.page_size = cache_config.page_size
        self.page_bytes = page_bytes
        self.shapes = BatchShapes.create(
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
            max_num_seqs=scheduler_config.max_num_seqs,
            max_model_len=scheduler_config.max_model_len,
            page_size=cache_config.page_size,
        )
        self.builder = BatchBuilder(self.shapes, cache_config.page_size)
        self._compiled: dict[tuple[int, int, StepOptions], Any] = {}

    def _kv_spec(self, *, num_pages: int, page_size: int) -> KVCacheSpec:
        return KVCacheSpec.for_platform(
            _platform(),
            num_pages=num_pages,
            page_size=page_size,
            num_kv_heads=self.cfg.num_kv_heads,
            head_dim=self.cfg.head_dim,
            dtype=self.cfg.dtype,
        )

    def _init_caches(self) -> Any:
        """One cache array per layer, laid out like the layer params (a list, or stacked)."""
        if isinstance(self.params["layers"], list):
            return [init_kv_pages(self.kv_spec) for _ in range(self.cfg.num_layers)]
        return init_kv_pages(self.kv_spec.replace(num_pages=self.num_pages))[None].repeat(
            self.cfg.num_layers, axis=0
        )

    # ---- compilation ---------------------------------------------------------------------

    def options(self, *, penalties: bool = False, num_top_logprobs: int = 0) -> StepOptions:
        return StepOptions(self.cfg, self.attention_impl, penalties, num_top_logprobs)

    def warm_up(self, *, progress: bool = True) -> float:
        """Compiles the step for every bucket; returns the seconds it took."""
        start = time.perf_counter()
        pairs = self.shapes.all_pairs()
        for t, s in tqdm(pairs, desc="compiling", unit="bucket", disable=not progress):
            self._executable(t, s, self.options())
        return time.perf_counter() - start

    def _executable(self, t: int, s: int, options: StepOptions) -> Any:
        key = (t, s, options)
        if key not in self._compiled:
            batch = self._abstract_batch(t, s, options)
            lowered = jitted_step.lower(self.params, self.kv_caches, batch, options=options)
            self._compiled[key] = lowered.compile()
            log.debug("compiled step for %d tokens, %d sequences (%s)", t, s, options)
        return self._compiled[key]

    def _abstract_batch(self, t: int, s: int, options: StepOptions) -> StepInput:
        example = self.builder.build_padded(
            SchedulerOutput(), None, t, s, penalties=options.apply_penalties
        )
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), example
        )

    @property
    def num_compiled(self) -> int:
        return len(self._compiled)

    # ---- execution -------------------------------------------------------------------------

    def execute(
        self,
        out: SchedulerOutput,
        kv_manager: kv_cache.KVCacheManager,
        *,
        penalties: bool,
        num_top_logprobs: int,
    ) -> StepOutput:
        """Runs one step; returns its outputs in NumPy (rows past the batch are padding)."""
        batch = self.builder.build(out, kv_manager, penalties=penalties)
        t, s = batch.token_ids.shape[0], batch.kv_lens.shape[0]
        options = self.options(penalties=penalties, num_top_logprobs=num_top_logprobs)
        executable = self._executable(t, s, options)
        result, self.kv_caches = executable(self.params, self.kv_caches, jax.device_put(batch))
        return jax.tree.map(np.asarray, result)
