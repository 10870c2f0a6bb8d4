"""A converted checkpoint restored onto a TP=2 (and a PP=2) mesh: each process reads from
storage only the slices its devices hold."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from orbax.checkpoint._src.serialization import serialization

from engine.weights import convert, open_checkpoint, resolve_model
from sharding.layout import ShardingLayout
from sharding.mesh import make_mesh
from sharding.rules import ShardingPlan
from tests.engine.tiny_model import write_tiny_checkpoint


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory):
    source = write_tiny_checkpoint(tmp_path_factory.mktemp("src"))
    out = tmp_path_factory.mktemp("converted") / "out"
    cfg, params = convert(str(source), out)
    return source, out, cfg, params


def test_tp2_restore_reads_only_each_devices_slice(converted, monkeypatch) -> None:
    _, out, cfg, params = converted
    reads: list[tuple[int, ...]] = []  # the shape of every block orbax reads from storage
    real = serialization._read_shard

    async def spy(t, *, new_shard_shape, **kwargs):
        reads.append(tuple(new_shard_shape))
        return await real(t, new_shard_shape=new_shard_shape, **kwargs)

    monkeypatch.setattr(serialization, "_read_shard", spy)
    layout = ShardingLayout.named(tp=2)
    plan = ShardingPlan.create(make_mesh(layout, jax.devices()[:2]), cfg, layout)
    restored = open_checkpoint(resolve_model(str(out))).load_params(plan)

    D, N, H = params["layers"][0]["wq"].shape
    assert cfg.num_heads == N == 4
    for layer, full in zip(restored["layers"], params["layers"], strict=True):
        wq = layer["wq"]
        assert wq.sharding == plan.param_shardings(full)["wq"]
        for shard in wq.addressable_shards:
            assert shard.data.shape == (D, N // 2, H)
            np.testing.assert_array_equal(shard.data, np.asarray(full["wq"])[shard.index])
    # Every leaf was read as the blocks its devices hold: a sharded one in two halves (never
    # whole), a replicated one (norms) whole, once.
    expected = []
    for leaf, sharding in zip(
        jax.tree.leaves(params), jax.tree.leaves(plan.param_shardings(params)), strict=True
    ):
        block = sharding.shard_shape(leaf.shape)
        expected += [block] * (1 if sharding.is_fully_replicated else 2)
    assert sorted(reads) == sorted(expected)
    assert (D, N, H) not in reads


def test_pp2_restore_stacks_each_stages_layers(converted) -> None:
    source, out, cfg, _ = converted
    layout = ShardingLayout.named(tp=2, pp=2)
    plan = ShardingPlan.create(make_mesh(layout, jax.devices()[:4]), cfg, layout)
    expected = open_checkpoint(resolve_model(str(source))).load_params(plan)
    restored = open_checkpoint(resolve_model(str(out))).load_params(plan)
    assert jax.tree.structure(restored) == jax.tree.structure(expected)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(expected), strict=True):
        assert got.sharding == want.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
