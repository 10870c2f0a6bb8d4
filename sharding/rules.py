"""Logical axis names on every parameter and on the KV cache, and the one table that maps them
to mesh axes. Pure: functions of static configuration and meshes; the model code never sees any
of it.

Tensor parallelism (`tp`) shards attention heads, the MLP width and the vocabulary; XLA inserts
the collectives the sharded matmuls need. A model with fewer KV heads than the tensor-parallel
size keeps its K/V projections replicated, and its cache stores one KV head per shard (each
shard the head its query heads use), as vLLM does. Pipeline parallelism (`pp`) splits the
stacked `layers` axis. The attention kernel runs per shard: `shard_attention` wraps it in a
`shard_map` over heads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from engine.config import ModelConfig
from engine.errors import XlaserveError

Axes = tuple[str | None, ...]

# Logical axes of each parameter leaf, by its name in the pytree (without the layer axis).
PARAM_AXES: Mapping[str, Axes] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("vocab", "embed"),
    "final_norm": ("embed",),
    "attn_norm": ("embed",),
    "mlp_norm": ("embed",),
    "post_attn_norm": ("embed",),  # Gemma's sandwich norms and QK-norm
    "post_mlp_norm": ("embed",),
    "q_norm": ("head_dim",),
    "k_norm": ("head_dim",),
    "wq": ("embed", "heads", "head_dim"),
    "wk": ("embed", "kv_heads", "head_dim"),
    "wv": ("embed", "kv_heads", "head_dim"),
    "wo": ("heads", "head_dim", "embed"),
    "bq": ("heads", "head_dim"),
    "bk": ("kv_heads", "head_dim"),
    "bv": ("kv_heads", "head_dim"),
    "w_gate": ("embed", "mlp"),
    "w_up": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),
}
# One layer's cache [pages, page_size, 2*Hkv, Dp] (K and V interleaved on the head axis, so a
# contiguous block of the axis holds whole K/V pairs); stacked caches lead with `layers`.
CACHE_AXES: Axes = ("pages", "page_slots", "kv_heads", "head_dim")

# The rules table: logical axis -> mesh axis (None: replicated).
RULES: Mapping[str, str | None] = {
    "vocab": "tp",
    "heads": "tp",
    "kv_heads": "tp",
    "mlp": "tp",
    "layers": "pp",
    "embed": None,
    "head_dim": None,
    "pages": None,
    "page_slots": None,
}


@dataclass(frozen=True)
class ShardingPlan:
    """How one engine's arrays lie on its (1, pp, tp) mesh. Hashable: a static jit argument."""

    mesh: Mesh
    num_heads: int
    num_kv_heads: int

    @classmethod
    def create(cls, mesh: Mesh, cfg: ModelConfig) -> ShardingPlan:
        tp = int(mesh.shape["tp"])
        if cfg.num_heads % tp:
            raise XlaserveError(
                f"tensor parallel size {tp} must divide the model's {cfg.num_heads} query heads"
            )
        if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
            raise XlaserveError(
                f"the model's {cfg.num_kv_heads} KV heads and tensor parallel size {tp} must "
                "divide one another"
            )
        if cfg.num_layers % int(mesh.shape["pp"]):
            raise XlaserveError(
                f"pipeline parallel size {mesh.shape['pp']} must divide the model's "
                f"{cfg.num_layers} layers"
            )
        return cls(mesh, cfg.num_heads, cfg.num_kv_heads)

    @property
    def tp(self) -> int:
        return int(self.mesh.shape["tp"])

    @property
    def pp(self) -> int:
        return int(self.mesh.shape["pp"])

    @property
    def kv_replicated(self) -> bool:
        """Fewer KV heads than shards: K/V projections replicated, one cache head per shard."""
        return self.num_kv_heads % self.tp != 0

    @property
    def cache_kv_heads(self) -> int:
        """KV heads the cache stores: the model's, or one per shard when replicated."""
        return self.tp if self.kv_replicated else self.num_kv_heads

    def rule(self, logical: str | None, *, cache: bool = False) -> str | None:
        if logical is None:
            return None
        if logical == "kv_heads" and self.kv_replicated and not cache:
            return None  # the parameters' few KV heads; the cache has one per shard
        return RULES[logical]

    def spec(self, axes: Axes, shape: tuple[int, ...], *, cache: bool = False) -> P:
        """The PartitionSpec of an array with these logical axes; a dimension the mesh axis
        does not divide (a vocabulary of 49,153 over 2) stays replicated."""
        if len(axes) != len(shape):
            raise ValueError(f"logical axes {axes} do not match {shape=}")
        mesh_axes = []
        for name, size in zip(axes, shape, strict=True):
            axis = self.rule(name, cache=cache)
            fits = axis is not None and size % int(self.mesh.shape[axis]) == 0
            mesh_axes.append(axis if fits else None)
        return P(*mesh_axes)

    def sharding(self, axes: Axes, shape: tuple[int, ...]) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(axes, shape))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def param_shardings(self, params: Any) -> Any:
        """A NamedSharding per parameter leaf (list-of-layers or stacked layout)."""
        return jax.tree_util.tree_map_with_path(
            lambda path, x: self.sharding(param_axes(path, x.ndim), tuple(x.shape)), params
        )

    def cache_sharding(self, shape: tuple[int, ...]) -> NamedSharding:
        """One layer's cache, or the stacked caches [layers, ...]."""
        axes = CACHE_AXES if len(shape) == len(CACHE_AXES) else ("layers", *CACHE_AXES)
        return NamedSharding(self.mesh, self.spec(axes, shape, cache=True))

    def shard_attention(self, attention: Callable[..., Any]) -> Callable[..., Any]:
        """Runs `attention(q, k, v, kv_pages, metadata, **static) -> (out, kv_pages)` per shard
        of heads: each shard writes and reads its own KV heads for its own query heads. `static`
        (the layer's sliding window) passes through unchanged."""
        heads = P(None, "tp", None)
        kv = P() if self.kv_replicated else heads
        cache = P(None, None, "tp", None)
        shards_per_kv_head = self.tp // self.num_kv_heads

        def local(
            q: jax.Array, k: jax.Array, v: jax.Array, pages: jax.Array, meta: Any, **static: Any
        ) -> Any:
            if self.kv_replicated:  # all KV heads are here; keep the one this shard's q use
                head = lax.axis_index("tp") // shards_per_kv_head
                k = lax.dynamic_slice_in_dim(k, head, 1, axis=1)
                v = lax.dynamic_slice_in_dim(v, head, 1, axis=1)
            return attention(q, k, v, pages, meta, **static)

        def sharded(
            q: jax.Array, k: jax.Array, v: jax.Array, pages: jax.Array, meta: Any, **static: Any
        ) -> Any:
            # Inside the pipeline's shard_map the context mesh (`pp` manual) is the one to use.
            # Every mesh axis is manual in here (Mosaic kernels cannot be auto-partitioned);
            # all but `tp` are replicated.
            context = jax.sharding.get_abstract_mesh()
            nested = not context.empty and bool(context.manual_axes)

            def body(q: jax.Array, k: jax.Array, v: jax.Array, pages: jax.Array, meta: Any) -> Any:
                return local(q, k, v, pages, meta, **static)

            fn = jax.shard_map(
                body,
                mesh=None if nested else self.mesh,
                in_specs=(heads, kv, kv, cache, P()),
                out_specs=(heads, cache),
                axis_names=set(self.mesh.axis_names) - set(context.manual_axes if nested else ()),
                check_vma=False,
            )
            return fn(q, k, v, pages, meta)

        return sharded


def param_axes(path: tuple[Any, ...], ndim: int) -> Axes:
    """Logical axes of the leaf at `path`: its name's entry, led by `layers` when stacked."""
    name = str(getattr(path[-1], "key", ""))
    if name not in PARAM_AXES:
        raise XlaserveError(f"no logical axes for parameter {jax.tree_util.keystr(path)}")
    axes = PARAM_AXES[name]
    if ndim == len(axes) + 1:
        return ("layers", *axes)
    if ndim != len(axes):
        raise XlaserveError(f"parameter {jax.tree_util.keystr(path)} has {ndim} dims, not {axes}")
    return axes
