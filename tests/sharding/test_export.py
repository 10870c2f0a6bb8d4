"""The tensor-parallel (TP=4) step, with the TPU attention kernel per shard, exports for TPU
on this CPU-only machine."""

from __future__ import annotations

import jax
import numpy as np
from jax import export
from jax.sharding import PartitionSpec as P

from engine.batch import BatchBuilder, BatchShapes
from engine.scheduler import SchedulerOutput
from engine.step import StepOptions, step
from pallas_kernels.kv_cache_update import KVCacheSpec
from sharding.layout import ShardingLayout
from sharding.mesh import make_mesh
from sharding.rules import ShardingPlan
from tests.pallas_kernels.test_export_step import CFG, random_params


def test_tp4_step_exports_for_tpu() -> None:
    layout = ShardingLayout.named(tp=4)
    mesh = make_mesh(layout, jax.devices()[:4])
    plan = ShardingPlan.create(mesh, CFG, layout)  # 2 KV heads < 4: replicated, one per shard
    page_size, num_tokens, num_seqs = 16, 32, 4
    spec = KVCacheSpec.for_platform(
        "tpu",
        num_pages=64,
        page_size=page_size,
        num_kv_heads=plan.cache_kv_heads,
        head_dim=CFG.head_dim,
    )
    shapes = BatchShapes.create(
        max_num_batched_tokens=num_tokens, max_num_seqs=num_seqs, max_model_len=256,
        page_size=page_size,
    )  # fmt: skip
    batch = BatchBuilder(shapes, page_size).build_padded(
        SchedulerOutput(), None, num_tokens, num_seqs, penalties=False
    )
    params = random_params(CFG)
    caches = [np.zeros(spec.shape, np.float32)] * CFG.num_layers

    def abstract(x: object, sharding: jax.sharding.Sharding) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=sharding)

    args = (
        jax.tree.map(abstract, params, plan.param_shardings(params)),
        [abstract(c, plan.cache_sharding(c.shape)) for c in caches],
        jax.tree.map(lambda x: abstract(x, plan.replicated), batch),
    )
    options = StepOptions(CFG, attention_impl="tpu", sharding=plan)
    jitted = jax.jit(step, static_argnames="options")
    exported = export.export(jitted, platforms=["tpu"])(*args, options=options)
    assert exported.platforms == ("tpu",)
    assert exported.nr_devices == 4
    assert "tpu_custom_call" in exported.mlir_module()
    # The cache stays sharded over heads: 4 shards of one KV head (K and V) each.
    shardings = exported.in_shardings_jax(mesh)
    num_params = len(jax.tree.leaves(params))
    for sharding in shardings[num_params : num_params + CFG.num_layers]:
        assert sharding.spec == P(None, None, "tp", None)
