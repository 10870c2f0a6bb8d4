"""Pipeline parallelism: the decoder layers split into stages over the layout's pipeline axis.

Inside the jitted step, one `shard_map` over that axis gives each stage its slice of the stacked
layers and of the stacked KV caches. The batch's T tokens are split into M micro-batches of T/M
rows; at tick t stage s runs micro-batch t - s and hands its activations to stage s + 1 (a
`ppermute`), so after the first ticks every stage is busy with a different micro-batch. M + PP - 1
ticks run the whole batch; the last stage's outputs are then shared with all (a `psum`).

A micro-batch is a range of rows of the ragged batch; its attention metadata says which part of
each sequence it holds: its rows of `cu_q_lens`, and `kv_lens` cut to the context up to its last
row. A stage runs micro-batches in order, so the K/V of a sequence's earlier rows are in its
cache when a later micro-batch attends to them. A stage with no micro-batch at a tick (the
pipeline filling or draining) computes on a copy and writes nothing (slots -1).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from engine.config import ModelConfig
from engine.errors import XlaserveError
from engine.models.attention import AttentionMetadata
from engine.models.layers import Params
from engine.models.registry import ModelFamily
from sharding.rules import ShardingPlan


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class MicroBatches:
    """Per micro-batch m (leading axis M) the parts of the batch that differ between them."""

    positions: Any  # i32[M, T/M]
    slot_mapping: Any  # i32[M, T/M]
    cu_q_lens: Any  # i32[M, S+1]; row offsets within the micro-batch
    kv_lens: Any  # i32[M, S]; context up to the micro-batch's last row of each sequence


def num_microbatches(num_tokens: int, num_stages: int) -> int:
    """As many micro-batches as stages (fewer would leave stages idle) when they divide T."""
    return num_stages if num_tokens % num_stages == 0 else 1


def split(meta: AttentionMetadata, positions: jax.Array, m: int) -> MicroBatches:
    """The batch's rows cut into m equal micro-batches."""
    rows = positions.shape[0] // m
    start = (jnp.arange(m, dtype=jnp.int32) * rows)[:, None]  # i32[M, 1]
    end = start + rows
    cu = meta.cu_q_lens[None, :]  # i32[1, S+1]
    rows_after = jnp.maximum(0, cu[:, 1:] - jnp.maximum(cu[:, :-1], end))  # i32[M, S]
    return MicroBatches(
        positions=positions.reshape(m, rows),
        slot_mapping=meta.slot_mapping.reshape(m, rows),
        cu_q_lens=jnp.clip(cu, start, end) - start,
        kv_lens=meta.kv_lens[None, :] - rows_after,
    )


def forward(
    family: ModelFamily,
    params: Params,
    caches: Any,  # stacked [L, ...]
    token_ids: jax.Array,  # i32[T]
    positions: jax.Array,  # i32[T]
    meta: AttentionMetadata,
    attend: Callable[..., Any],  # (q, k, v, kv_pages, meta) -> (out, kv_pages)
    *,
    plan: ShardingPlan,
    cfg: ModelConfig,
) -> tuple[jax.Array, Any]:
    """The model's forward with its layers pipelined: final hidden states f[T, D] and caches."""
    if family.embed is None or family.decoder is None or family.final_norm is None:
        raise XlaserveError(f"model family {family.name!r} does not support pipeline parallelism")
    if isinstance(params["layers"], list):
        raise ValueError("pipeline parallelism needs the layers stacked on a leading axis")
    axis = plan.layout.pipeline_axis
    assert axis is not None  # a plan with stages has a pipeline axis
    x = family.embed(params, token_ids, cfg=cfg)
    t = x.shape[0]
    m = num_microbatches(t, plan.num_stages)
    stages = functools.partial(
        _stages,
        decoder=functools.partial(family.decoder, cfg=cfg),
        attend=attend,
        meta=meta,
        axis=axis,
    )
    run = jax.shard_map(
        stages,
        mesh=plan.mesh,
        in_specs=(P(axis), P(axis), P(), P()),
        out_specs=(P(), P(axis)),
        axis_names={axis},
        check_vma=False,
    )
    out, caches = run(params["layers"], caches, x.reshape(m, t // m, -1), split(meta, positions, m))
    return family.final_norm(params, out.reshape(t, -1), cfg=cfg), caches


def _stages(
    layers: Params,  # this stage's [L/PP, ...]
    caches: Any,  # this stage's [L/PP, ...]
    inputs: jax.Array,  # f[M, T/M, D] the embedded micro-batches
    micro: MicroBatches,
    *,
    decoder: Callable[..., tuple[jax.Array, Any]],
    attend: Callable[..., Any],
    meta: AttentionMetadata,
    axis: str,  # the pipeline's mesh axis
) -> tuple[jax.Array, Any]:
    num_stages = lax.axis_size(axis)
    stage = lax.axis_index(axis)
    m = inputs.shape[0]
    to_next = [(s, (s + 1) % num_stages) for s in range(num_stages)]

    def tick(t: jax.Array, carry: tuple[jax.Array, jax.Array, Any]) -> Any:
        received, outputs, caches = carry
        i = t - stage  # this stage's micro-batch at this tick
        active = (i >= 0) & (i < m)
        i = jnp.clip(i, 0, m - 1)
        x = jnp.where(stage == 0, inputs[jnp.minimum(t, m - 1)], received)
        part = AttentionMetadata(
            slot_mapping=jnp.where(active, micro.slot_mapping[i], -1),
            kv_lens=micro.kv_lens[i],
            page_table=meta.page_table,
            cu_q_lens=micro.cu_q_lens[i],
            num_seqs=meta.num_seqs,
        )

        def attention(
            q: jax.Array, k: jax.Array, v: jax.Array, kv_pages: jax.Array, **static: Any
        ) -> Any:
            return attend(q, k, v, kv_pages, part, **static)

        y, caches = decoder(layers, x, micro.positions[i], caches, attention)
        done = active & (stage == num_stages - 1)
        outputs = outputs.at[i].set(jnp.where(done, y, outputs[i]))
        return lax.ppermute(y, axis, to_next), outputs, caches

    carry = (jnp.zeros_like(inputs[0]), jnp.zeros_like(inputs), caches)
    _, outputs, caches = lax.fori_loop(0, m + num_stages - 1, tick, carry)
    outputs = lax.psum(jnp.where(stage == num_stages - 1, outputs, 0), axis)
    return outputs, caches
