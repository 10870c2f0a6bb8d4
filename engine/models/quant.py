"""Weight-only quantization as a parameter leaf: int8 or packed int4 values with group scales.

A `QuantizedWeight` stands where a float weight would in the params pytree and keeps that
weight's layout (so sharding rules that name the float weight's axes apply to its values and
scales alike); only `axis`, the contraction (input) axis, is cut into groups of consecutive
elements, each with one float32 scale and, for asymmetric int4, one offset:

    w[..., i, ...] = q[..., i, ...] * scale[..., i // group, ...] + offset[..., i // group, ...]

int8 per output channel is one group spanning the whole axis; GGUF blocks are groups of 32.
int4 values are unsigned nibbles 0..15, two per byte along `axis` (element 2j in the low
nibble of byte j, element 2j+1 in the high one).

Device memory holds the quantized arrays. The model's products take them as they are
(`product`: on CPU a C++ kernel reads the integers in place for decode-sized batches, otherwise
XLA dequantizes inside the jitted step); `dequantize` gives the float weight anywhere else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import cpu

BITS = (4, 8)
# Contraction axis of each linear weight of the Llama family's params (see models/layers.py):
# wq/wk/wv [D, N, H] and the MLP [D, F]/[F, D] contract their first axis; wo [N, H, D] groups
# along H (within a head, so a TP shard of heads holds whole groups); the embedding [V, D]
# contracts D when it is the output layer, and a token lookup reads whole rows.
QUANTIZED_AXIS = {
    "wq": 0,
    "wk": 0,
    "wv": 0,
    "wo": 1,
    "w_gate": 0,
    "w_up": 0,
    "w_down": 0,
    "embed": 1,
    "lm_head": 1,
    # experts [E, D, 2, F] and [E, F, D] contract their second axis; each expert's own groups
    "we_gate_up": 1,
    "we_down": 1,
}


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedWeight:
    """A linear weight held as integers and group scales; `dequantize` gives the float one."""

    values: Any  # i8[shape] (bits 8) or u8[shape with `axis` halved] (bits 4, two per byte)
    scales: Any  # f32[shape with `axis` divided by the group size]; f16 if int8_activations
    offsets: Any  # like scales (asymmetric), or None (symmetric)
    bits: int = field(metadata=dict(static=True))
    axis: int = field(metadata=dict(static=True))
    dtype: str = field(metadata=dict(static=True))  # what `dequantize` returns
    # The CPU kernel may round activations to int8 (see `product`); a choice, not the weight's.
    int8_activations: bool = field(default=False, metadata=dict(static=True))
    # None: the arrays are this weight's. An int: they stack every layer's weight on a leading
    # axis and this weight is the layer-th (`layer_view`), which the CPU kernel reads in place;
    # `sliced` gives its own arrays. The properties below describe the one layer's weight.
    layer: int | None = field(default=None, metadata=dict(static=True))

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {self.bits}")

    @property
    def shape(self) -> tuple[int, ...]:
        """The float weight's shape."""
        shape = list(self._own_shape(self.values))
        shape[self.axis] *= 8 // self.bits
        return tuple(shape)

    @property
    def group_size(self) -> int:
        return self.shape[self.axis] // self._own_shape(self.scales)[self.axis]

    @property
    def nbytes(self) -> int:
        parts = (self.values, self.scales, self.offsets)
        stacked = sum(int(x.size) * x.dtype.itemsize for x in parts if x is not None)
        return stacked if self.layer is None else stacked // self.values.shape[0]

    def _own_shape(self, x: Any) -> tuple[int, ...]:
        return tuple(x.shape) if self.layer is None else tuple(x.shape[1:])


def layer_view(w: QuantizedWeight, layer: int) -> QuantizedWeight:
    """The layer-th weight of `w`, whose arrays stack every layer's weight [L, ...] (see
    `QuantizedWeight.layer`): the same arrays, not a slice of them."""
    return dataclasses.replace(w, layer=layer)


def sliced(w: QuantizedWeight) -> QuantizedWeight:
    """`w` with arrays of its own: a layer view's slices of the stacks (XLA copies them where it
    does not fuse the slice into their use, as dequantizing does)."""
    if w.layer is None:
        return w
    own = lambda x: None if x is None else x[w.layer]
    return dataclasses.replace(
        w, values=own(w.values), scales=own(w.scales), offsets=own(w.offsets), layer=None
    )


def unpack_int4(packed: jax.Array, axis: int) -> jax.Array:
    """u8[..., n/2, ...] -> u8[..., n, ...]: the low nibble of byte j is element 2j."""
    both = jnp.stack([packed & 0xF, packed >> 4], axis=axis + 1)
    shape = list(packed.shape)
    shape[axis] *= 2
    return both.reshape(shape)


def dequantize(w: QuantizedWeight) -> jax.Array:
    """The float weight, in `w.dtype` (computed in float32)."""
    w = sliced(w)
    q = unpack_int4(w.values, w.axis) if w.bits == 4 else w.values
    axis, groups = w.axis, w.scales.shape[w.axis]
    grouped = (*q.shape[:axis], groups, q.shape[axis] // groups, *q.shape[axis + 1 :])
    x = q.astype(jnp.float32).reshape(grouped) * jnp.expand_dims(w.scales, axis + 1)
    if w.offsets is not None:
        x = x + jnp.expand_dims(w.offsets, axis + 1)
    return x.reshape(q.shape).astype(jnp.dtype(w.dtype))


def as_matrix(w: QuantizedWeight) -> QuantizedWeight:
    """A linear weight as [In, Out] (contraction first): [D, N, H] -> [D, N*H] for q/k/v,
    [N, H, D] -> [N*H, D] for the output projection (groups lie within a head, so a group of
    the merged axis is still one of H's); a 2-D weight as it is. A layer view's stacks keep
    their leading layer axis."""
    ndim = len(w.shape)
    if ndim == 2:
        return w
    lead = w.values.shape[:1] if w.layer is not None else ()  # the stack's layer axis
    if w.axis == 0:
        merge = lambda x: x.reshape(*lead, x.shape[len(lead)], -1)
    elif w.axis == ndim - 2:
        merge = lambda x: x.reshape(*lead, -1, x.shape[-1])
    else:
        raise ValueError(f"cannot flatten a weight of shape {w.shape} grouped along {w.axis}")
    parts = (w.values, w.scales, w.offsets)
    values, scales, offsets = (None if x is None else merge(x) for x in parts)
    return dataclasses.replace(w, values=values, scales=scales, offsets=offsets, axis=0)


# The CPU kernel reads the integers in place (one or two rows of x stream the weights; more rows
# meet each dequantized block in L1); the other path writes a float copy of the whole weight
# first. One int4 576x1536 product on the 2-core Intel machine (busy; best of 7 per run, two
# runs): the kernel 0.20-0.21 ms at 16 rows, 0.7-1.4 ms at 64 and 3.6 ms at 128; dequantizing
# 0.5-1.9, 1.0-1.1 and 1.8 ms. Larger prefill chunks are dequantized.
KERNEL_MAX_ROWS = 64


def product(x: jax.Array, w: QuantizedWeight, *, transposed: bool) -> jax.Array:
    """f[T, In] @ w (a [In, Out] weight, grouped along In) or @ w.T (a [Out, In] table grouped
    along In), in float32. On CPU, for up to KERNEL_MAX_ROWS rows, the C++ kernel reads the
    integers in place; elsewhere the weight is dequantized and multiplied. For a weight marked
    for int8 activations (an int4 [In, Out] one in groups of 32k) the kernel rounds x to int8
    in blocks of 32. The dequantized path keeps x in float, which is more exact and costs no
    more; a prompt's result then depends on whether it shared a prefill chunk of more than
    KERNEL_MAX_ROWS rows (llama.cpp's results depend on its batch size too)."""

    def dequantized(x: jax.Array) -> jax.Array:
        table = dequantize(w)
        spec = "TD,VD->TV" if transposed else "TD,DV->TV"
        return jnp.einsum(spec, x.astype(table.dtype), table, preferred_element_type=jnp.float32)

    if x.shape[0] > KERNEL_MAX_ROWS or not _kernel_takes(w, transposed):
        return dequantized(x)

    def kernel(x: jax.Array) -> jax.Array:
        return cpu.quantized_matmul(
            x,
            w.values,
            w.scales,
            w.offsets,
            bits=w.bits,
            transposed=transposed,
            int8_activations=_int8_activations(w, transposed),
            layer=w.layer,
        )

    return jax.lax.platform_dependent(x, cpu=kernel, default=dequantized)


def products(x: jax.Array, ws: Sequence[QuantizedWeight]) -> list[jax.Array]:
    """[product(x, w, transposed=False) for w in ws], the same bit for bit, in one kernel call
    where the kernel takes every weight (int4 in the same groups of 32k, offsets on all or
    none, those with 8-bit activations with scales of one dtype): q, k and v (k and v keep float
    activations), gate and up. That saves calls' dispatch and their wake-ups of the kernels'
    thread pool: 0.2-0.5 ms a token for gate and up in SmolLM2's 30 layers; for q, k and v a
    median 0.13 ms a step in the engine (0.47 ms timed alone, bench/RESULTS.md)."""
    first = ws[0]
    int8 = [_int8_activations(w, transposed=False) for w in ws]
    int8_scales = {w.scales.dtype for w, flag in zip(ws, int8, strict=True) if flag}

    def alike(w: QuantizedWeight) -> bool:
        return (
            _kernel_takes(w, transposed=False)
            and w.bits == 4
            and w.group_size % 32 == 0
            and w.group_size == first.group_size
            and w.layer == first.layer
            and (w.offsets is None) == (first.offsets is None)
        )

    def one_each(x: jax.Array) -> list[jax.Array]:
        return [product(x, w, transposed=False) for w in ws]

    fits = len(int8_scales) <= 1 and all(alike(w) for w in ws)
    if len(ws) < 2 or x.shape[0] > KERNEL_MAX_ROWS or not fits:
        return one_each(x)

    def kernel(x: jax.Array) -> list[jax.Array]:
        parts = [(w.values, w.scales, w.offsets) for w in ws]
        return cpu.quantized_matmuls(x, parts, int8_activations=int8, layer=first.layer)

    return jax.lax.platform_dependent(x, cpu=kernel, default=one_each)


def _kernel_takes(w: QuantizedWeight, transposed: bool) -> bool:
    """The shapes `pallas_kernels.cpu.quantized_matmul` supports (and the library is built)."""
    if len(w.shape) != 2 or w.axis != (1 if transposed else 0):
        return False
    group, out = w.group_size, w.shape[0 if transposed else 1]
    if transposed:
        fits = group % (16 if w.bits == 8 else 32) == 0 and w.shape[1] <= 4096
    else:
        fits = group % 2 == 0 and out % 64 == 0
    if w.scales.dtype != jnp.float32 and not _int8_activations(w, transposed):
        return False  # float16 scales: only the 8-bit-activation path reads them
    return fits and cpu.available()


def _int8_activations(w: QuantizedWeight, transposed: bool) -> bool:
    """Whether the kernel rounds x to int8 for `w`: asked for, and either an int4 [In, Out]
    weight in groups of 32k or an int8 [Out, In] table (the output layer, as llama.cpp's Q8_0
    one) in groups of 32k with In a multiple of 64; other weights keep float activations."""
    if not w.int8_activations or w.group_size % 32 != 0:
        return False
    if transposed:
        return w.bits == 8 and w.offsets is None and w.shape[1] % 64 == 0
    return w.bits == 4


def take_rows(w: jax.Array | QuantizedWeight, ids: jax.Array) -> jax.Array:
    """w[ids] of a [V, D] table, dequantizing only the rows taken (groups run along D)."""
    if not isinstance(w, QuantizedWeight):
        return w[ids]
    if w.axis == 0:
        raise ValueError("take_rows needs groups along the row (axis 1), not across rows")
    return dequantize(jax.tree.map(lambda x: x[ids], sliced(w)))


# The key and value projections keep float activations: what they write to the cache is read
# by every later token, and rounding their inputs to int8 cost SmolLM2 most of its error (KL
# from the float model over 64 tokens of text: 0.019 nats with every product rounded, 0.007
# without these two; they are 6% of a layer's weight bytes).
FLOAT_ACTIVATIONS = ("wk", "wv")


def with_int8_activations(params: Any) -> Any:
    """The params with the quantized weights marked for 8-bit activations (`product`), but
    those named in FLOAT_ACTIVATIONS. Those the kernel then takes (int4 [In, Out] weights and
    int8 tables in groups of 32k) keep their scales and offsets as float16, as llama.cpp's Q4_1
    and Q8_0 blocks do: exact for weights read from such blocks, a rounding of at most 2^-11
    relative for others (above 6e-5, float16's smallest normal number), and 20 bytes read per
    32 int4 weights instead of 24 (34 per 32 int8 ones instead of 36)."""

    def mark(path: tuple[Any, ...], x: Any) -> Any:
        name = getattr(path[-1], "key", None) if path else None
        if not isinstance(x, QuantizedWeight) or name in FLOAT_ACTIVATIONS:
            return x
        marked = dataclasses.replace(x, int8_activations=True)
        matrix = x.values.ndim in (2, 3) and x.axis in (0, x.values.ndim - 2)
        table = x.values.ndim == 2 and x.axis == 1  # [V, D] grouped along D: embedding, lm_head
        takes = (matrix and _int8_activations(marked, transposed=False)) or (
            table and _int8_activations(marked, transposed=True)
        )
        if not takes:
            return marked
        offsets = None if x.offsets is None else x.offsets.astype(jnp.float16)
        return dataclasses.replace(marked, scales=x.scales.astype(jnp.float16), offsets=offsets)

    is_weight = lambda x: isinstance(x, QuantizedWeight)
    return jax.tree_util.tree_map_with_path(mark, params, is_leaf=is_weight)


def weight_bytes(params: Any) -> int:
    """Bytes of every array in the params pytree (quantized values, scales and offsets)."""
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(params))
