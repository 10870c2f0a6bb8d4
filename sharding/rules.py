"""Logical axis names on every parameter and on the KV cache, and how a sharding layout
(`sharding.layout`) applies to them. Pure: functions of static configuration and meshes; the
model code never sees any of it.

The built-in layout's tensor parallelism shards attention heads, the MLP width and the
vocabulary; XLA inserts the collectives the sharded matmuls need. A model with fewer KV heads
than the heads' shards keeps its K/V projections replicated, and its cache stores one KV head
per shard (each shard the head its query heads use), as vLLM does. Pipeline parallelism splits
the stacked `layers` axis over the layout's pipeline axis. The attention kernel runs per shard:
`shard_attention` wraps it in a `shard_map` over the heads' mesh axis.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import jax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from engine.config import EXPERT_DISPATCHES, ModelConfig
from engine.errors import XlaserveError
from sharding.experts import ExpertAxes, all_to_all_body
from sharding.layout import LayoutError, ShardingLayout
from sharding.mesh import slice_mesh

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
    # LoRA slots [slots, in..., rank] and [slots, rank, out...] (engine/lora_slots.py): A split
    # along its base weight's input axes, B along its output axes, as the base weight is.
    "wq_lora_a": (None, "embed", None),
    "wq_lora_b": (None, None, "heads", "head_dim"),
    "wk_lora_a": (None, "embed", None),
    "wk_lora_b": (None, None, "kv_heads", "head_dim"),
    "wv_lora_a": (None, "embed", None),
    "wv_lora_b": (None, None, "kv_heads", "head_dim"),
    "wo_lora_a": (None, "heads", "head_dim", None),
    "wo_lora_b": (None, None, "embed"),
    "w_gate_lora_a": (None, "embed", None),
    "w_gate_lora_b": (None, None, "mlp"),
    "w_up_lora_a": (None, "embed", None),
    "w_up_lora_b": (None, None, "mlp"),
    "w_down_lora_a": (None, "mlp", None),
    "w_down_lora_b": (None, None, "embed"),
    # Mixture of experts: experts split over the `expert` axis, each expert's width like `mlp`.
    "router": ("embed", None),
    "we_gate_up": ("expert", "embed", None, "mlp"),
    "we_down": ("expert", "mlp", "embed"),
}
# One layer's cache [pages, page_size, 2*Hkv, Dp] (K and V interleaved on the head axis, so a
# contiguous block of the axis holds whole K/V pairs); stacked caches lead with `layers`.
CACHE_AXES: Axes = ("pages", "page_slots", "kv_heads", "head_dim")


def model_dims(cfg: ModelConfig) -> dict[str, int]:
    """The size of each logical axis the model's arrays have (the cache's pages aside)."""
    return {
        "vocab": cfg.vocab_size,
        "embed": cfg.hidden_size,
        "heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "mlp": cfg.intermediate_size,
        "layers": cfg.num_layers,
        **({"expert": cfg.num_experts} if cfg.num_experts else {}),
    }


def check_layout(layout: ShardingLayout, cfg: ModelConfig, num_devices: int | None = None) -> None:
    """Refuses, with a one-line XlaserveError, a layout that cannot shard this model (see
    `ShardingLayout.validate`), or that splits one array twice over a mesh axis."""
    try:
        layout.validate(num_devices=num_devices, dims=model_dims(cfg))
        for name, axes in (*PARAM_AXES.items(), ("KV cache", CACHE_AXES)):
            _check_distinct(layout, name, ("layers", *axes))
    except LayoutError as e:
        raise XlaserveError(f"sharding layout: {e}") from e


def _check_distinct(layout: ShardingLayout, name: str, axes: Axes) -> None:
    seen: dict[str, str] = {}
    for logical in axes:
        axis = None if logical is None else layout.rule(logical)
        if axis is not None and axis in seen:
            raise LayoutError(
                f"{seen[axis]!r} and {logical!r} both map to mesh axis {axis!r}, and {name} has "
                "both: an array is split at most once over a mesh axis"
            )
        if axis is not None and logical is not None:
            seen[axis] = logical


@dataclass(frozen=True)
class ShardingPlan:
    """How one engine's arrays lie on its mesh: the layout applied to the model. Hashable: a
    static jit argument (with the layout in it, so no two layouts share a compiled step)."""

    mesh: Mesh
    layout: ShardingLayout
    num_heads: int
    num_kv_heads: int
    expert_dispatch: str = "allgather"  # one of engine.config.EXPERT_DISPATCHES

    def __post_init__(self) -> None:
        if self.expert_dispatch not in EXPERT_DISPATCHES:
            raise XlaserveError(
                f"expert dispatch must be one of {', '.join(EXPERT_DISPATCHES)}, "
                f"not {self.expert_dispatch!r}"
            )

    @classmethod
    def create(
        cls,
        mesh: Mesh,
        cfg: ModelConfig,
        layout: ShardingLayout,
        *,
        expert_dispatch: str = "allgather",
    ) -> ShardingPlan:
        """`mesh`: the layout's mesh, or one replica's (`sharding.mesh.replica_meshes`).
        `expert_dispatch`: how a mixture of experts' tokens reach the devices of the expert
        axis (`sharding.experts`)."""
        check_layout(layout, cfg)
        replica = {layout.replica_axis: 1} if layout.replica_axis is not None else {}
        full, sliced = dict(layout.mesh), {**dict(layout.mesh), **replica}
        if tuple(mesh.axis_names) != layout.axis_names or dict(mesh.shape) not in (full, sliced):
            raise XlaserveError(
                f"the mesh {dict(mesh.shape)} is not the sharding layout's ({layout.describe()})"
            )
        return cls(mesh, layout, cfg.num_heads, cfg.num_kv_heads, expert_dispatch)

    def _size(self, logical: str) -> int:
        axis = self.layout.rule(logical)
        return 1 if axis is None else int(self.mesh.shape[axis])

    @property
    def num_stages(self) -> int:
        """Pipeline stages (1: no pipeline)."""
        return self._size("layers")

    @property
    def head_shards(self) -> int:
        """Into how many parts the query heads are split."""
        return self._size("heads")

    @property
    def cache_shards(self) -> int:
        """Over how many devices one KV cache is split (heads and pipeline stages)."""
        return self.head_shards * self.num_stages

    @property
    def kv_replicated(self) -> bool:
        """Fewer KV heads than shards: K/V projections replicated, one cache head per shard."""
        return self.num_kv_heads % self.head_shards != 0

    @property
    def cache_kv_heads(self) -> int:
        """KV heads the cache stores: the model's, or one per shard when replicated."""
        return self.head_shards if self.kv_replicated else self.num_kv_heads

    def rule(self, logical: str | None, *, cache: bool = False) -> str | None:
        if logical is None:
            return None
        if logical == "kv_heads" and self.kv_replicated and not cache:
            return None  # the parameters' few KV heads; the cache has one per shard
        return self.layout.rule(logical)

    def spec(self, axes: Axes, shape: tuple[int, ...], *, cache: bool = False) -> P:
        """The PartitionSpec of an array with these logical axes. A dimension its mesh axis
        does not divide stays replicated: what `check_layout` allows (an odd vocabulary with
        `replicate_if_indivisible`) and the small axes of quantization scales."""
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

    def shard_experts(self, experts: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
        """Runs `experts(x, weights, ids, we_gate_up, we_down, first_expert) -> f[T, D]`
        (`engine.models.moe.grouped_experts`) per shard of the expert weights: every device sees
        all tokens and their routing (replicated), computes the pairs routed to its experts with
        its slice of their width, and a psum over the expert and width axes adds the parts.
        With `expert_dispatch` "all_to_all", tokens go to their experts' devices and back
        instead (`sharding.experts`)."""
        gate_up_axes, down_axes = PARAM_AXES["we_gate_up"], PARAM_AXES["we_down"]

        def sharded(
            x: jax.Array, weights: jax.Array, ids: jax.Array, gate_up: Any, down: Any
        ) -> Any:
            gate_up_spec = self.spec(gate_up_axes, tuple(gate_up.shape))
            down_spec = self.spec(down_axes, tuple(down.shape))
            axes = {"expert": gate_up_spec[0], "mlp": gate_up_spec[3]}
            context = jax.sharding.get_abstract_mesh()
            nested = not context.empty and bool(context.manual_axes)
            fn = jax.shard_map(
                self._expert_body(experts, down.shape[0], axes),
                mesh=None if nested else self.mesh,
                in_specs=(P(), P(), P(), gate_up_spec, down_spec),
                out_specs=P(),
                axis_names=set(self.mesh.axis_names) - set(context.manual_axes if nested else ()),
                check_vma=False,
            )
            return fn(x, weights, ids, gate_up, down)

        return sharded

    def _expert_body(
        self, experts: Callable[..., jax.Array], num_experts: int, axes: dict[str, str | None]
    ) -> Callable[..., jax.Array]:
        """The shard_map body of `shard_experts`, as `expert_dispatch` says."""
        axis = axes["expert"]
        num_local = num_experts // (1 if axis is None else self._size("expert"))
        if self.expert_dispatch == "allgather" or axis is None:
            return _expert_body(experts, num_local, axes)
        split = ExpertAxes(axis, self._size("expert"), num_local, width=axes["mlp"])
        return all_to_all_body(experts, split, num_experts)

    def stage(self, index: int) -> ShardingPlan:
        """The plan on one pipeline stage's devices (the pipeline axis cut to that stage)."""
        if self.layout.pipeline_axis is None:
            return self
        return replace(self, mesh=slice_mesh(self.mesh, self.layout.pipeline_axis, index))

    def shard_attention(self, attention: Callable[..., Any]) -> Callable[..., Any]:
        """Runs `attention(q, k, v, kv_pages, metadata, **static) -> (out, kv_pages)` per shard
        of heads: each shard writes and reads its own KV heads for its own query heads. `static`
        (the layer's sliding window) passes through unchanged."""
        axis = self.layout.rule("heads")
        heads = P(None, axis, None)
        kv = P() if self.kv_replicated else heads
        cache = P(*(self.rule(name, cache=True) for name in CACHE_AXES))
        shards_per_kv_head = self.head_shards // self.num_kv_heads

        def local(
            q: jax.Array, k: jax.Array, v: jax.Array, pages: jax.Array, meta: Any, **static: Any
        ) -> Any:
            if self.kv_replicated:  # all KV heads are here; keep the one this shard's q use
                assert axis is not None  # replicated K/V means the heads are split
                head = lax.axis_index(axis) // shards_per_kv_head
                k = lax.dynamic_slice_in_dim(k, head, 1, axis=1)
                v = lax.dynamic_slice_in_dim(v, head, 1, axis=1)
            return attention(q, k, v, pages, meta, **static)

        def sharded(
            q: jax.Array, k: jax.Array, v: jax.Array, pages: jax.Array, meta: Any, **static: Any
        ) -> Any:
            # Inside the pipeline's shard_map the context mesh (its axis manual) is the one to
            # use. Every mesh axis is manual in here (Mosaic kernels cannot be auto-partitioned);
            # all but the heads' axis are replicated.
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


def _expert_body(
    experts: Callable[..., jax.Array], num_local: int, axes: dict[str, str | None]
) -> Callable[..., jax.Array]:
    """One shard's part of `experts`: its experts' pairs (first_expert from its index on the
    expert axis), summed over the shards of experts and of their width."""
    summed = tuple(axis for axis in axes.values() if axis is not None)

    def body(x: jax.Array, weights: jax.Array, ids: jax.Array, gate_up: Any, down: Any) -> Any:
        axis = axes["expert"]
        first = 0 if axis is None else lax.axis_index(axis) * num_local
        out = experts(x, weights, ids, gate_up, down, first)
        return lax.psum(out, summed) if summed else out

    return body


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
