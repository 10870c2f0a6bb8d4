"""Expert-parallel token dispatch: how the devices of the `expert` mesh axis share a mixture of
experts' tokens. `ShardingPlan.shard_experts` picks one of `engine.config.EXPERT_DISPATCHES`
(ParallelConfig's `expert_dispatch`, the `--expert-dispatch` flag):

- "allgather": every device holds every token (the attention's output is replicated, so the
  gather costs nothing), runs the token-expert pairs of its own experts and a psum over the
  expert axis adds the parts (vLLM's allgather/reduce-scatter scheme). It moves one f[T, D] sum
  per layer whatever the routing.
- "all_to_all": each device takes its 1/EP slice of the tokens, sends each of its pairs to the
  device that holds the pair's expert, which runs its experts over the rows it received and
  sends the results back; the sender weights and sums them, and an all-gather over the expert
  axis rebuilds the replicated activations the next attention needs. It moves the routed rows
  (about T*k*D each way over the whole axis) plus the gather of f[T, D].

With the attention replicated over the expert axis, as it is here, a device sends
(EP-1)/EP * T * D * (2k/EP + 1) values under "all_to_all" against 2 (EP-1)/EP * T * D under
"allgather" (`bytes_moved`, balanced routing): fewer only when EP > 2k. The all-to-all pays
more where tokens are not replicated to begin with (attention data-parallel over the expert
axis), which xlaserve does not do yet; "allgather" stays the default.

Both keep the psum over the width axis when tensor parallelism also splits each expert's
width. Shapes are static: T is padded to a multiple of EP, a device sends at most M = T/EP * k
rows to one destination and receives at most EP * M. On TPU and GPU the exchange is
`jax.lax.ragged_all_to_all` (only the routed rows travel); XLA:CPU has no ragged all-to-all, so
there `ragged_exchange` does the same with `jax.lax.all_to_all` and a capacity of M rows per
destination, which never drops a pair. The bookkeeping (sizes and offsets) is the same code
on every platform, so the CPU tests check the one the accelerators run; of the collective
itself they check only that TPU and GPU lower to it (tests/sharding/test_expert_dispatch.py).

The receiving device returns each row's expert output in the activations' dtype and the sender
weights it in float32: in bfloat16 that is one rounding more than on one device, where the
weighting comes before the cast.

Shapes: T tokens (Tp padded), D model width, k experts per token, EP devices on the expert
axis, E_local experts each, M = Tp/EP * k pairs of one device, R = EP * M received rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


@dataclass(frozen=True)
class ExpertAxes:
    """The mesh axes one MoE layer's experts are split over, inside the shard_map.

    expert: the mesh axis of experts (EP = `num_shards` devices, `num_local` experts each).
    width: the mesh axis that splits each expert's width (tensor parallelism), or None.
    """

    expert: str
    num_shards: int
    num_local: int
    width: str | None = None

    def __post_init__(self) -> None:
        if self.num_shards < 1 or self.num_local < 1:
            raise ValueError(f"{self.num_shards=} and {self.num_local=} must be positive")


class Routes(NamedTuple):
    """Where one device's pairs go and where the rows it receives come from; each i32[EP],
    indexed by the other device's position on the expert axis."""

    send_sizes: jax.Array  # pairs I send to each device
    send_offsets: jax.Array  # where they start in my expert-sorted pairs
    remote_offsets: jax.Array  # where they land in that device's received rows
    recv_sizes: jax.Array  # rows each device sends me
    recv_offsets: jax.Array  # where they start in my received rows
    back_offsets: jax.Array  # where they started in that device's expert-sorted pairs


def routes(pair_experts: jax.Array, axes: ExpertAxes) -> Routes:
    """The routes of pairs with these experts (i32[M], sorted; `num_experts` for padding,
    which goes nowhere), from every device's send sizes: sizes[s, d] rows go from s to d."""
    me = lax.axis_index(axes.expert)
    destination = pair_experts // axes.num_local  # padding: EP, one past the last device
    send_sizes = jnp.bincount(destination, length=axes.num_shards + 1)[:-1].astype(jnp.int32)
    sizes = lax.all_gather(send_sizes, axes.expert)  # i32[EP, EP]: source, destination
    before_source = jnp.cumsum(sizes, axis=0) - sizes  # rows earlier sources send d
    before_destination = jnp.cumsum(sizes, axis=1) - sizes  # rows s sends earlier devices
    return Routes(
        send_sizes=send_sizes,
        send_offsets=before_destination[me],
        remote_offsets=before_source[me],
        recv_sizes=sizes[:, me],
        recv_offsets=before_source[:, me],
        back_offsets=before_destination[:, me],
    )


def ragged_exchange(
    operand: jax.Array,  # [N, ...]: rows for each device, contiguous
    output: jax.Array,  # [N_out, ...]: what the received rows are written over
    input_offsets: jax.Array,  # i32[EP]
    send_sizes: jax.Array,  # i32[EP]
    output_offsets: jax.Array,  # i32[EP]: where my rows land on each device
    recv_sizes: jax.Array,  # i32[EP]
    *,
    axis: str,
    capacity: int,
) -> jax.Array:
    """`jax.lax.ragged_all_to_all` on TPU and GPU; on CPU the same with a padded
    `lax.all_to_all` of `capacity` rows per destination (at least any send size)."""

    def padded() -> jax.Array:
        return _padded_exchange(
            operand, output, input_offsets, output_offsets, recv_sizes,
            axis=axis, capacity=capacity,
        )  # fmt: skip

    def ragged() -> jax.Array:
        return lax.ragged_all_to_all(
            operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
            axis_name=axis,
        )  # fmt: skip

    return lax.platform_dependent(cpu=padded, default=ragged)


def _padded_exchange(
    operand: jax.Array,  # [N, ...]
    output: jax.Array,  # [N_out, ...]
    input_offsets: jax.Array,  # i32[EP]
    output_offsets: jax.Array,  # i32[EP]
    recv_sizes: jax.Array,  # i32[EP]
    *,
    axis: str,
    capacity: int,
) -> jax.Array:
    """ragged_all_to_all's result from a dense all-to-all: each destination gets the
    `capacity` rows from its offset on (the rows past its send size are dropped there), and the
    offset at which to write them."""
    num_shards = input_offsets.shape[0]
    tail = jnp.zeros((capacity, *operand.shape[1:]), operand.dtype)
    padded = jnp.concatenate([operand, tail])  # every window of `capacity` rows is in range

    def window(start: jax.Array) -> jax.Array:
        return lax.dynamic_slice_in_dim(padded, start, capacity)

    chunks = jax.vmap(window)(input_offsets)  # [EP, C, ...]: one per destination
    got = lax.all_to_all(chunks, axis, 0, 0, tiled=True)  # [EP, C, ...]: one per source
    at = lax.all_to_all(output_offsets, axis, 0, 0, tiled=True)  # i32[EP]: per source
    row = jnp.arange(capacity)
    position = jnp.where(row < recv_sizes[:, None], at[:, None] + row, output.shape[0])
    rows = got.reshape(num_shards * capacity, *operand.shape[1:])
    return output.at[position.reshape(-1)].set(rows, mode="drop")


def all_to_all_body(
    experts: Callable[..., jax.Array], axes: ExpertAxes, num_experts: int
) -> Callable[..., jax.Array]:
    """One device's part of the all-to-all dispatch, inside a shard_map over the mesh:
    (x f[T, D], weights f32[T, k], ids i32[T, k] replicated, its expert weights) -> f[T, D]
    replicated. `experts` is `engine.models.moe.grouped_experts`."""

    def body(x: jax.Array, weights: jax.Array, ids: jax.Array, gate_up: Any, down: Any) -> Any:
        num_tokens, top_k = ids.shape
        xs, ws, pair_experts = _token_slice(x, weights, ids, axes, num_experts)
        order = jnp.argsort(pair_experts, stable=True)  # i32[M]: sorted position -> pair
        sorted_experts = pair_experts[order]
        plan = routes(sorted_experts, axes)
        rows, local_ids = _send(xs[order // top_k], sorted_experts, plan, axes, num_experts)
        out = _run_received(experts, rows, local_ids, gate_up, down, axes)  # f[R, D]
        back = _send_back(out, plan, axes, num_pairs=order.shape[0])  # f[M, D], sorted
        pair_out = jnp.zeros_like(back).at[order].set(back)  # f[M, D], pair order
        weighted = pair_out.astype(jnp.float32) * ws[:, None]
        combined = jnp.sum(weighted.reshape(-1, top_k, x.shape[1]), axis=1).astype(x.dtype)
        return lax.all_gather(combined, axes.expert, tiled=True)[:num_tokens]  # f[T, D]

    return body


def _token_slice(
    x: jax.Array,  # f[T, D]
    weights: jax.Array,  # f32[T, k]
    ids: jax.Array,  # i32[T, k]
    axes: ExpertAxes,
    num_experts: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """This device's 1/EP of the tokens f[Tp/EP, D], their pair weights f32[M] and experts
    i32[M]; T padded to Tp, a multiple of EP, with pairs of expert `num_experts` (nowhere)."""
    pad = -x.shape[0] % axes.num_shards
    x = jnp.pad(x, ((0, pad), (0, 0)))
    weights = jnp.pad(weights, ((0, pad), (0, 0)))
    ids = jnp.pad(ids, ((0, pad), (0, 0)), constant_values=num_experts)
    size = x.shape[0] // axes.num_shards
    start = lax.axis_index(axes.expert) * size

    def mine(a: jax.Array) -> jax.Array:
        return lax.dynamic_slice_in_dim(a, start, size)

    return mine(x), mine(weights).reshape(-1), mine(ids).reshape(-1)


def _send(
    rows: jax.Array,  # f[M, D]: each pair's token, the pairs sorted by expert
    sorted_experts: jax.Array,  # i32[M]: their experts; num_experts for padding
    plan: Routes,
    axes: ExpertAxes,
    num_experts: int,
) -> tuple[jax.Array, jax.Array]:
    """Each pair's row to the device holding its expert: the rows this device receives
    f[R, D] and their experts' local indices i32[R] (num_local past the received rows). A
    device sends at most its M pairs to another: the capacity of the CPU exchange."""
    num_pairs, dim = rows.shape
    received = num_pairs * axes.num_shards

    def send(operand: jax.Array, output: jax.Array) -> jax.Array:
        return ragged_exchange(
            operand, output, plan.send_offsets, plan.send_sizes, plan.remote_offsets,
            plan.recv_sizes, axis=axes.expert, capacity=num_pairs,
        )  # fmt: skip

    local = sorted_experts % axes.num_local
    local = jnp.where(sorted_experts < num_experts, local, axes.num_local)[:, None]  # i32[M, 1]
    got_rows = send(rows, jnp.zeros((received, dim), rows.dtype))
    got_ids = send(local, jnp.full((received, 1), axes.num_local, local.dtype))
    return got_rows, got_ids[:, 0]


def _send_back(out: jax.Array, plan: Routes, axes: ExpertAxes, *, num_pairs: int) -> jax.Array:
    """The received rows' results f[R, D] back to their senders, each in its place among the
    sender's expert-sorted pairs f[M, D] (padding pairs: zero)."""
    return ragged_exchange(
        out, jnp.zeros((num_pairs, out.shape[1]), out.dtype), plan.recv_offsets,
        plan.recv_sizes, plan.back_offsets, plan.send_sizes, axis=axes.expert,
        capacity=num_pairs,
    )  # fmt: skip


def _run_received(
    experts: Callable[..., jax.Array],
    rows: jax.Array,  # f[R, D]
    local_ids: jax.Array,  # i32[R]: num_local where no row was received
    gate_up: Any,
    down: Any,
    axes: ExpertAxes,
) -> jax.Array:
    """Each received row through its (local) expert, unweighted: the sender weights it. With
    the width split, the parts of each row are summed over the width axis. f[R, D]"""
    ones = jnp.ones((rows.shape[0], 1), jnp.float32)
    out = experts(rows, ones, local_ids[:, None], gate_up, down, 0)
    return out if axes.width is None else lax.psum(out, axes.width)


def bytes_moved(
    num_tokens: int, dim: int, top_k: int, num_shards: int, itemsize: int
) -> dict[str, float]:
    """Bytes one device sends per MoE layer under each dispatch, from the shapes alone, with a
    balanced routing (each device's pairs spread evenly over the experts): a ring all-reduce of
    f[T, D] for "allgather"; for "all_to_all" the routed rows out and back (the (EP-1)/EP of
    its pairs held elsewhere) and its slice in the all-gather. "all_to_all_padded" is the padded
    exchange of XLA:CPU, a full capacity of M rows to every other device both ways."""
    n = num_shards
    rows = -(-num_tokens // n) * n
    pairs = rows // n * top_k
    row = dim * itemsize
    gather = (n - 1) * (rows // n) * row
    return {
        "allgather": 2 * (n - 1) / n * num_tokens * row,
        "all_to_all": 2 * pairs * (n - 1) / n * row + gather,
        "all_to_all_padded": 2 * (n - 1) * pairs * row + gather,
    }
