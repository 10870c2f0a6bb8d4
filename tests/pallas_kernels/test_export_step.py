"""The whole engine step (projections, KV write, the platform's attention kernel, logits,
sampling) lowers and exports for TPU and for CUDA on this CPU-only machine, for a dense model
and for a mixture of experts (Qwen3-MoE-like: QK-norm, 8 experts, top 2)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax import export

from engine.batch import BatchBuilder, BatchShapes
from engine.config import ModelConfig
from engine.models import registry
from engine.scheduler import SchedulerOutput
from engine.step import StepOptions, step
from pallas_kernels.kv_cache_update import KVCacheSpec
from pallas_kernels.ragged_paged_attention import gpu
from tests.pallas_kernels.gpu_lowering import needs_cuda_lowering

CFG = ModelConfig(
    architecture="llama",
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    max_position_embeddings=256,
)
MOE_CFG = CFG.replace(
    intermediate_size=128, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
    qk_norm="head",
)  # fmt: skip


def random_params(cfg: ModelConfig) -> dict:
    rng = np.random.default_rng(0)
    params: dict = {"layers": [{} for _ in range(cfg.num_layers)]}
    for spec in registry.family(cfg).hf_tensor_specs(cfg).values():
        value = spec.convert(rng.standard_normal(spec.shape).astype(np.float32))
        *parents, leaf = spec.path
        node = params
        for key in parents:
            node = node[key]
        node[leaf] = value
    return params


@pytest.mark.parametrize("cfg", [CFG, MOE_CFG], ids=["dense", "moe"])
@pytest.mark.parametrize(
    ("platform", "impl", "disabled"),
    [
        ("tpu", "tpu", ()),
        pytest.param("cuda", "gpu", gpu.EXPORT_DISABLED_CHECKS, marks=needs_cuda_lowering()),
    ],
)
def test_step_exports(platform: str, impl: str, disabled: tuple, cfg: ModelConfig) -> None:
    page_size, num_tokens, num_seqs = 16, 32, 4
    spec = KVCacheSpec.for_platform(
        "tpu" if platform == "tpu" else "gpu",
        num_pages=64,
        page_size=page_size,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
    )
    shapes = BatchShapes.create(
        max_num_batched_tokens=num_tokens,
        max_num_seqs=num_seqs,
        max_model_len=256,
        page_size=page_size,
    )
    batch = BatchBuilder(shapes, page_size).build_padded(
        SchedulerOutput(), None, num_tokens, num_seqs, penalties=False
    )

    def abstract(x: object) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)

    args = jax.tree.map(
        abstract, (random_params(cfg), [np.zeros(spec.shape, np.float32)] * 2, batch)
    )
    options = StepOptions(cfg, attention_impl=impl)
    jitted = jax.jit(step, static_argnames="options")
    exported = export.export(jitted, platforms=[platform], disabled_checks=list(disabled))(
        *args, options=options
    )
    text = exported.mlir_module()
    assert exported.platforms == (platform,)
    assert ("tpu_custom_call" if platform == "tpu" else "__gpu$xla.gpu.triton") in text
    if cfg.num_experts:  # the experts as a grouped matmul, not the CPU's dense product
        assert "ragged_dot" in text
