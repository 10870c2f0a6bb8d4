"""Layers shared by the model families: pure functions of arrays and static numbers.

Shapes: T tokens, D model width, N query heads, K kv heads, H head dim, F MLP width.
Weights are stored input-major (`x @ w`), with heads as their own axis so that
sharding rules can name them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from engine.config import RopeScaling
from engine.models import quant
from engine.models.quant import QuantizedWeight
from pallas_kernels import cpu

Params = dict[str, Any]


class AttentionFn(Protocol):
    """attention(q f[T, N, H], k f[T, K, H], v f[T, K, H], layer_cache, sliding_window=W)
    -> (f[T, N, H], layer_cache). The model passes each layer's own window (a static int, or
    None for a layer that sees the whole context)."""

    def __call__(
        self, q: jax.Array, k: jax.Array, v: jax.Array, cache: Any, /, *, sliding_window: int | None
    ) -> tuple[jax.Array, Any]: ...


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, offset: float = 0.0) -> jax.Array:
    """RMSNorm computed in float32, returned in x's dtype; `offset` is 1 for Gemma's `1 + w`."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * (offset + weight.astype(jnp.float32))).astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """Inverse frequencies f32[H/2], computed on the host from static config (as HF does)."""
    exponents = np.arange(0, head_dim, 2).astype(np.float32) / head_dim
    inv_freq = 1.0 / theta**exponents
    if scaling is None:
        return inv_freq.astype(np.float32)
    if scaling.rope_type == "linear":
        return (inv_freq / scaling.factor).astype(np.float32)
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between
    # interpolated smoothly.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotary embedding in the "rotate half" convention of HF checkpoints.

    x: f[T, N, H]; positions: i32[T]; inv_freq: f32[H/2].
    """
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # f32[T, H/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, None, :].astype(x.dtype)
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos + rotated * sin


Weight = jax.Array | QuantizedWeight  # a float weight, or one dequantized where it is used

# XLA:CPU hands a bf16 product to its fast matmul kernels (~3x the f32 rate on this AMX machine)
# only when the result is f32 and there are a few rows; a 1-row bf16 product took a slow loop
# (~15x f32's time at SmolLM2's output layer, measured), so fewer rows are padded up to this.
MIN_LOW_PRECISION_ROWS = 4


def _padded_rows(x: jax.Array, w: jax.Array) -> jax.Array:
    pad = MIN_LOW_PRECISION_ROWS - x.shape[0] if w.dtype != jnp.float32 else 0
    return jnp.pad(x, ((0, pad), (0, 0))) if pad > 0 else x


def dense(x: jax.Array, w: Weight) -> jax.Array:
    """f[T, In] @ f[In, Out] -> f[T, Out] in x's dtype, accumulated in float32.

    A float32 accumulator is what bf16 weights need for accuracy, and on CPU also for speed;
    for float32 weights this is a plain matmul. A quantized weight is multiplied as it is
    (`quant.product`).
    """
    if isinstance(w, QuantizedWeight):
        return quant.product(x, quant.as_matrix(w), transposed=False).astype(x.dtype)

    def xla(x: jax.Array) -> jax.Array:
        out = jnp.dot(_padded_rows(x, w).astype(w.dtype), w, preferred_element_type=jnp.float32)
        return out[: x.shape[0]].astype(x.dtype)

    if not _few_rows_kernel_takes(x, w):
        return xla(x)
    kernel = functools.partial(cpu.dense_matmul, w=w, transposed=False)
    return jax.lax.platform_dependent(x, cpu=kernel, default=xla)


def dense_all(x: jax.Array, ws: Sequence[Weight]) -> list[jax.Array]:
    """[dense(x, w) for w in ws]: x against several weights (gate and up), quantized ones the
    kernel takes alike in one call (`quant.products`)."""
    quantized = [w for w in ws if isinstance(w, QuantizedWeight) and len(w.shape) == 2]
    if len(quantized) == len(ws):
        return [y.astype(x.dtype) for y in quant.products(x, quantized)]
    return [dense(x, w) for w in ws]


def unembed(x: jax.Array, table: Weight) -> jax.Array:
    """f[T, D] against an embedding table f[V, D] -> f32[T, V] logits."""
    if isinstance(table, QuantizedWeight):
        return quant.product(x, table, transposed=True)

    def xla(x: jax.Array) -> jax.Array:
        x32 = _padded_rows(x, table).astype(table.dtype)
        return jnp.einsum("TD,VD->TV", x32, table, preferred_element_type=jnp.float32)[: x.shape[0]]

    if not _few_rows_kernel_takes(x, table):
        return xla(x)
    kernel = functools.partial(cpu.dense_matmul, w=table, transposed=True)
    return jax.lax.platform_dependent(x, cpu=kernel, default=xla)


# XLA:CPU multiplies one float32 row by a weight in a matrix-vector loop, but 2 to 16 rows (a
# decode batch, a speculative verification's K + 1 positions) as a general product that packs
# the whole weight first, at up to twice one row's time; the C++ kernel reads it in place.
MIN_KERNEL_ROWS = 2


def _few_rows_kernel_takes(x: jax.Array, w: jax.Array) -> bool:
    """Whether `pallas_kernels.cpu.dense_matmul` takes f32[T, In] @ w on CPU (the platform is
    chosen at lowering, `jax.lax.platform_dependent`)."""
    width = w.shape[1]  # [In, Out]: the output columns; [Out, In]: the input width
    return (
        x.dtype == w.dtype == jnp.float32
        and w.ndim == 2
        and MIN_KERNEL_ROWS <= x.shape[0] <= cpu.DENSE_MAX_ROWS
        and width % 16 == 0
        and cpu.available()
    )


def project_to_heads(x: jax.Array, w: Weight) -> jax.Array:
    """f[T, D] @ f[D, N, H] -> f[T, N, H], as one 2-D matmul: XLA:CPU runs the equivalent
    3-D einsum ~1.7x slower at decode shapes (measured), and the reshapes are free."""
    d, n, h = w.shape
    if isinstance(w, QuantizedWeight):
        return dense(x, w).reshape(x.shape[0], n, h)
    return dense(x, w.reshape(d, n * h)).reshape(x.shape[0], n, h)


def project_all_to_heads(x: jax.Array, ws: Sequence[Weight]) -> list[jax.Array]:
    """[project_to_heads(x, w) for w in ws] (q, k and v), the same values, quantized weights
    the kernel takes alike in one call (`dense_all`)."""
    quantized = [w for w in ws if isinstance(w, QuantizedWeight)]
    if len(quantized) < len(ws):
        return [project_to_heads(x, w) for w in ws]
    outs = dense_all(x, [quant.as_matrix(w) for w in quantized])
    return [y.reshape(x.shape[0], *w.shape[1:]) for y, w in zip(outs, quantized, strict=True)]


def project_from_heads(x: jax.Array, w: Weight) -> jax.Array:
    """f[T, N, H] @ f[N, H, D] -> f[T, D], as one 2-D matmul (see `project_to_heads`)."""
    n, h, d = w.shape
    flat = x.reshape(x.shape[0], n * h)
    return dense(flat, w) if isinstance(w, QuantizedWeight) else dense(flat, w.reshape(n * h, d))


def gated_mlp(x: jax.Array, p: Params, activation: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """SwiGLU (silu) or GeGLU (gelu): down(act(x @ gate) * (x @ up))."""
    gate, up = dense_all(x, (p["w_gate"], p["w_up"]))
    return dense(activation(gate) * up, p["w_down"])


def dense_causal_attention(
    q: jax.Array,  # f[T, N, H]
    k: jax.Array,  # f[T, K, H]
    v: jax.Array,  # f[T, K, H]
    positions: jax.Array,  # i32[T]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_soft_cap: float | None = None,
) -> jax.Array:
    """Attention of one whole sequence over itself: the naive oracle, O(T^2)."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    q = q.reshape(q.shape[0], num_kv_heads, num_heads // num_kv_heads, q.shape[2])
    scores = jnp.einsum("TKGH,SKH->KGTS", q, k, preferred_element_type=jnp.float32) * sm_scale
    if logit_soft_cap is not None:
        scores = logit_soft_cap * jnp.tanh(scores / logit_soft_cap)
    distance = positions[:, None] - positions[None, :]  # i32[T, S]
    visible = distance >= 0
    if sliding_window is not None:
        visible &= distance < sliding_window
    scores = jnp.where(visible, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("KGTS,SKH->TKGH", probs, v)
    return out.reshape(out.shape[0], num_heads, out.shape[-1])


def run_layers(
    layer_fn: Callable[..., tuple[jax.Array, Any]],
    x: jax.Array,
    layers: list[Params] | Params,
    caches: Any,
    *,
    variants: Sequence[Hashable] | None = None,
) -> tuple[jax.Array, Any]:
    """Applies `layer_fn(x, params, cache)` over the layers: unrolled for a list of per-layer
    params, a `lax.scan` for params stacked on a leading layer axis (one compile for any depth).
    Stacked params with a list of per-layer caches are unrolled too, each layer's params taken
    by `layer_params` (the CPU's layout for quantized weights: a step passes XLA a few stacks,
    not every layer's arrays, and each layer's kernel reads its own in place).

    `variants`, one static value per layer (Gemma 3: local or global), is passed to `layer_fn`
    as `variant=`; the scan picks each layer's variant with `lax.switch`.
    Which is faster is platform-dependent (see shared/BASELINES.md); the model is the same.
    """
    if isinstance(layers, list) or isinstance(caches, list):
        if not isinstance(layers, list):
            layers = [layer_params(layers, i) for i in range(len(caches))]
        caches = [None] * len(layers) if caches is None else caches
        kinds = [None] * len(layers) if variants is None else list(variants)
        new_caches = []
        for i, (layer, cache, kind) in enumerate(zip(layers, caches, kinds, strict=True)):
            fn = layer_fn if variants is None else functools.partial(layer_fn, variant=kind)
            with jax.named_scope(f"layer_{i}"):
                x, cache = fn(x, layer, cache)
            new_caches.append(cache)
        return x, new_caches

    if variants is None:

        def body(h: jax.Array, layer_and_cache: tuple[Params, Any]) -> tuple[jax.Array, Any]:
            return layer_fn(h, *layer_and_cache)

        return jax.lax.scan(body, x, (layers, caches))

    distinct = list(dict.fromkeys(variants))
    branches = [functools.partial(layer_fn, variant=kind) for kind in distinct]
    index = jnp.asarray([distinct.index(kind) for kind in variants], jnp.int32)  # i32[L]

    def switch_body(h: jax.Array, xs: tuple[jax.Array, Params, Any]) -> tuple[jax.Array, Any]:
        i, layer, cache = xs
        return jax.lax.switch(i, branches, h, layer, cache)

    return jax.lax.scan(switch_body, x, (index, layers, caches))


def stack_layers(layers: list[Params]) -> Params:
    """Per-layer params -> one pytree with a leading layer axis (for `lax.scan`)."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *layers)


def layer_params(layers: Params, i: int) -> Params:
    """Layer i of params stacked on a leading layer axis, inside a jitted unrolled loop: its
    quantized weights as views of the stacks (`quant.layer_view`), other arrays sliced (norms
    and biases: small, and XLA fuses the slice into their use)."""
    is_weight = lambda x: isinstance(x, QuantizedWeight)
    take = lambda x: quant.layer_view(x, i) if is_weight(x) else x[i]
    return jax.tree.map(take, layers, is_leaf=is_weight)
