"""The all-to-all expert dispatch (sharding/experts.py) as a function on 8 simulated devices:
experts split over EP 2, 4, 8 and EP 2 x TP 2 give what one device computes (within 1e-5),
with random routing and with a forced one where two experts get every token and the other six
none, the tokens padded to a multiple of EP. The padded exchange XLA:CPU
runs matches ragged_all_to_all's documented semantics (a NumPy model of them), and the
accelerator lowering uses the real ragged all-to-all."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from engine.models import moe
from sharding.experts import ragged_exchange
from sharding.layout import ShardingLayout
from sharding.mesh import make_mesh
from sharding.rules import PARAM_AXES, ShardingPlan

E, D, F, K = 8, 64, 32, 2
FORCED = (5, 3)  # every token's two experts under the forced routing
TOLERANCE = 1e-5
NUM_TOKENS = 13  # padded to a multiple of each EP: 14 or 16 (one shape: one compilation)


def plan_for(ep: int, tp: int) -> ShardingPlan:
    rules = {"expert": "ep"} | ({"mlp": "tp"} if tp > 1 else {})
    layout = ShardingLayout.create({"ep": ep, "tp": tp}, rules)
    mesh = make_mesh(layout, jax.devices()[: ep * tp])
    return ShardingPlan(mesh, layout, num_heads=4, num_kv_heads=2, expert_dispatch="all_to_all")


@pytest.fixture(scope="module")
def expert_weights() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    gate_up = rng.normal(scale=0.3, size=(E, D, 2, F)).astype(np.float32)
    down = rng.normal(scale=0.3, size=(E, F, D)).astype(np.float32)
    return gate_up, down


@pytest.fixture(scope="module")
def one_device():
    """The oracle: the experts on one device (`moe.grouped_experts`, as without parallelism)."""
    return jax.jit(moe.grouped_experts)


def routing(kind: str, num_tokens: int, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """Tokens f32[T, D], weights f32[T, K] and experts i32[T, K]: from a random router, or
    FORCED for every token."""
    x = rng.normal(size=(num_tokens, D)).astype(np.float32)
    if kind == "random":
        router = rng.normal(size=(D, E)).astype(np.float32)
        weights, ids = moe.route(jnp.asarray(x), jnp.asarray(router), top_k=K, normalize=True)
        return x, np.asarray(weights), np.asarray(ids)
    weights = rng.uniform(0.2, 1.0, size=(num_tokens, K)).astype(np.float32)
    return x, weights, np.tile(np.asarray(FORCED, np.int32), (num_tokens, 1))


@pytest.mark.parametrize(
    ("ep", "tp"), [(2, 1), (4, 1), (8, 1), (2, 2)], ids=["ep2", "ep4", "ep8", "ep2-tp2"]
)
def test_all_to_all_dispatch_matches_one_device(expert_weights, one_device, ep, tp):
    gate_up, down = expert_weights
    plan = plan_for(ep, tp)
    sharded = (
        jax.device_put(gate_up, plan.sharding(PARAM_AXES["we_gate_up"], gate_up.shape)),
        jax.device_put(down, plan.sharding(PARAM_AXES["we_down"], down.shape)),
    )
    run = jax.jit(plan.shard_experts(moe.grouped_experts))
    rng = np.random.default_rng(ep * 10 + tp)
    for kind in ("random", "forced"):
        x, weights, ids = routing(kind, NUM_TOKENS, rng)
        want = one_device(x, weights, ids, gate_up, down)
        inputs = [jax.device_put(a, plan.replicated) for a in (x, weights, ids)]
        got = run(*inputs, *sharded)
        assert np.abs(np.asarray(want)).max() > 0.5  # the bound is tight at this scale
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=TOLERANCE)


def reference_ragged_all_to_all(operands, outputs, in_offsets, send, out_offsets):
    """jax.lax.ragged_all_to_all's documented result, device by device: sender s's rows
    operands[s][in_offsets[s][r] : + send[s][r]] land in receiver r's output from
    out_offsets[s][r] on."""
    results = [o.copy() for o in outputs]
    for s, r in np.ndindex(len(operands), len(operands)):
        n = send[s][r]
        src, dst = in_offsets[s][r], out_offsets[s][r]
        results[r][dst : dst + n] = operands[s][src : src + n]
    return np.stack(results)


def test_padded_exchange_is_ragged_all_to_all():
    """Rows spread with gaps on both sides (offsets not the cumulative sums of the sizes)."""
    ep, rows, out_rows = 4, 12, 20
    rng = np.random.default_rng(1)
    send = rng.integers(0, 3, size=(ep, ep)).astype(np.int32)  # send[s, r]
    in_offsets = np.cumsum(send + 1, axis=1) - send - 1 + rng.integers(0, 2, size=(ep, 1))
    out_offsets = (np.cumsum(send + 1, axis=0) - send).astype(np.int32)  # a gap before each
    operands = rng.normal(size=(ep, rows, 3)).astype(np.float32)
    outputs = np.full((ep, out_rows, 3), -1.0, np.float32)
    want = reference_ragged_all_to_all(operands, outputs, in_offsets, send, out_offsets)

    mesh = jax.make_mesh((ep,), ("ep",), devices=jax.devices()[:ep])
    spec = P("ep")

    def body(operand, output, in_off, sizes, out_off, recv):
        return ragged_exchange(
            operand[0], output[0], in_off[0], sizes[0], out_off[0], recv[0],
            axis="ep", capacity=rows,
        )[None]  # fmt: skip

    args = (operands, outputs, in_offsets.astype(np.int32), send, out_offsets, send.T.copy())
    placed = [jax.device_put(a, NamedSharding(mesh, spec)) for a in args]
    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 6, out_specs=spec))
    np.testing.assert_array_equal(np.asarray(run(*placed)), want)


def test_all_to_all_dispatch_exports_ragged_all_to_all_for_tpu_and_cuda(expert_weights):
    """TPU and GPU exchange only the routed rows (ragged_all_to_all, 3 per layer: rows and
    experts out, results back); XLA:CPU the padded all-to-all."""
    gate_up, down = expert_weights
    plan = plan_for(4, 2)

    def abstract(a: np.ndarray, sharding: jax.sharding.Sharding) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

    x, weights, ids = routing("random", 16, np.random.default_rng(2))
    args = (
        *(abstract(a, plan.replicated) for a in (x, weights, ids)),
        abstract(gate_up, plan.sharding(PARAM_AXES["we_gate_up"], gate_up.shape)),
        abstract(down, plan.sharding(PARAM_AXES["we_down"], down.shape)),
    )
    run = jax.jit(plan.shard_experts(moe.grouped_experts))
    # ragged_all_to_all is a custom call without jax.export's compatibility guarantee: a module
    # that uses it must run with the jax version that exported it.
    unchecked = [export.DisabledSafetyCheck.custom_call("ragged_all_to_all")]
    accelerators = export.export(run, platforms=["tpu", "cuda"], disabled_checks=unchecked)(*args)
    module = accelerators.mlir_module()
    assert accelerators.platforms == ("tpu", "cuda")
    assert module.count("stablehlo.custom_call @ragged_all_to_all") == 3
    assert "stablehlo.all_to_all" not in module
    cpu = export.export(run, platforms=["cpu"])(*args).mlir_module()
    assert "@ragged_all_to_all" not in cpu
    assert "stablehlo.all_to_all" in cpu
