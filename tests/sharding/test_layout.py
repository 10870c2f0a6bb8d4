"""ShardingLayout as a value: the built-in layouts are today's table, files and Python give equal
(hashable) values, and each kind of invalid layout is refused with one line naming the axis
and the numbers. No engine: these need no compilation."""

from __future__ import annotations

import sys

import jax
import pytest

from engine.config import ModelConfig
from engine.errors import XlaserveError
from sharding.layout import LayoutError, ShardingLayout
from sharding.mesh import make_mesh, replica_meshes
from sharding.rules import ShardingPlan, check_layout

# The sharding table before layouts existed (sharding/rules.py's RULES), as the oracle of the
# built-in layouts: logical axis -> mesh axis of the (dp, pp, tp) mesh.
OLD_RULES = {"vocab": "tp", "heads": "tp", "kv_heads": "tp", "mlp": "tp", "layers": "pp"}
CFG = ModelConfig(
    architecture="llama",
    vocab_size=49153,
    hidden_size=64,
    intermediate_size=96,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)
DIMS = {"vocab": 49153, "embed": 64, "heads": 4, "kv_heads": 2, "mlp": 96, "layers": 3}


def test_named_layout_is_the_old_table() -> None:
    layout = ShardingLayout.named(dp=2, pp=3, tp=4)
    assert layout.axis_names == ("dp", "pp", "tp")
    assert layout.shape == (2, 3, 4)
    assert layout.num_devices == 24
    assert {name: layout.rule(name) for name in OLD_RULES} == OLD_RULES
    assert dict(layout.rules) == OLD_RULES  # nothing else is split
    assert (layout.replica_axis, layout.pipeline_axis) == ("dp", "pp")


def test_layout_values_from_dicts_and_files_are_equal(tmp_path) -> None:
    schema = {
        "mesh": {"data": 1, "x": 2, "y": 4},
        "rules": {"mlp": "x", "vocab": "x", "heads": "y", "kv_heads": "y", "embed": None},
        "replica_axis": "data",
    }
    reordered = {**schema, "rules": {"kv_heads": "y", "heads": "y", "vocab": "x", "mlp": "x"}}
    layout = ShardingLayout.from_dict(schema)
    assert ShardingLayout.from_dict(reordered) == layout
    assert hash(ShardingLayout.from_dict(reordered)) == hash(layout)
    assert ShardingLayout.from_dict(layout.to_dict()) == layout
    (tmp_path / "l.json").write_text(
        '{"mesh": {"data": 1, "x": 2, "y": 4}, "replica_axis": "data",'
        ' "rules": {"mlp": "x", "vocab": "x", "heads": "y", "kv_heads": "y"}}'
    )
    (tmp_path / "l.yaml").write_text(
        "mesh: {data: 1, x: 2, y: 4}\nreplica_axis: data\n"
        "rules:\n  mlp: x\n  vocab: x\n  heads: y\n  kv_heads: y\n"
    )
    assert ShardingLayout.from_file(tmp_path / "l.json") == layout
    assert ShardingLayout.from_file(tmp_path / "l.yaml") == layout
    assert layout != ShardingLayout.from_dict({**schema, "mesh": {"data": 1, "y": 4, "x": 2}})


def test_yaml_without_pyyaml_names_the_package(tmp_path, monkeypatch) -> None:
    (tmp_path / "l.yml").write_text("mesh: {x: 8}\n")
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml raises ImportError
    with pytest.raises(LayoutError, match=r"l\.yml: reading a YAML layout needs the PyYAML"):
        ShardingLayout.from_file(tmp_path / "l.yml")


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        (
            {"mesh": {"x": 8}, "rules": {"experts": "x"}},
            "rule for unknown logical axis 'experts'; the logical axes are vocab, embed,",
        ),
        (
            {"mesh": {"x": 8}, "rules": {"mlp": "z"}},
            "rule 'mlp' -> 'z' names no mesh axis; the mesh is x=8",
        ),
        ({"mesh": {"x": 0, "y": 8}}, "mesh axis 'x' must have a size >= 1, got 0"),
        (
            {"mesh": {"x": 2, "y": 4}, "rules": {"heads": "y", "kv_heads": "x"}},
            "'kv_heads' -> 'x' must be split like 'heads' -> 'y'",
        ),
        (
            {"mesh": {"x": 8}, "rules": {"head_dim": "x"}},
            "rule 'head_dim' -> 'x': 'head_dim' cannot be split",
        ),
        (
            {"mesh": {"pp": 2, "tp": 4}, "rules": {"mlp": "pp"}, "pipeline_axis": "pp"},
            "rule 'mlp' -> 'pp': the pipeline axis splits only 'layers'",
        ),
        (
            {"mesh": {"dp": 2, "tp": 4}, "rules": {"vocab": "dp"}, "replica_axis": "dp"},
            "rule 'vocab' -> 'dp': the replica axis separates engine replicas",
        ),
        (
            {"mesh": {"a": 2, "b": 4}, "rules": {"layers": "a"}},
            "rule 'layers' -> 'a' differs from pipeline_axis None",
        ),
        ({"mesh": {"x": 8}, "rule": {}}, "unknown layout key 'rule'"),
        ({"mesh": {"x": 8}, "pipeline_axis": "pp"}, "pipeline_axis 'pp' is not a mesh axis"),
    ],
    ids=[
        "logical",
        "mesh-axis",
        "size",
        "kv-heads",
        "head-dim",
        "pipeline",
        "replica",
        "layers",
        "key",
        "role",
    ],
)
def test_invalid_layout_is_refused_in_one_line(schema, message) -> None:
    with pytest.raises(LayoutError) as error:
        ShardingLayout.from_dict(schema)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("schema", "dims", "message"),
    [
        (
            {"mesh": {"s": 2, "t": 4}, "rules": {"mlp": "t"}, "pipeline_axis": "s"},
            DIMS,
            "mesh axis 's' of size 2 does not divide the model's 'layers' (3)",
        ),
        (
            {"mesh": {"t": 8}, "rules": {"mlp": "t", "vocab": "t"}},
            DIMS,
            "mesh axis 't' of size 8 does not divide the model's 'vocab' (49153)",
        ),
        (
            {"mesh": {"t": 2}, "rules": {"heads": "t", "kv_heads": "t"}},
            {**DIMS, "heads": 6, "kv_heads": 3},
            "mesh axis 't' of size 2 does not divide the model's 'kv_heads' (3)",
        ),
        ({"mesh": {"e": 8}, "rules": {"expert": "e"}}, DIMS, "the model has no 'expert' axis"),
    ],
    ids=["layers", "vocab", "kv-heads", "expert"],
)
def test_layout_that_cannot_split_the_model_is_refused(schema, dims, message) -> None:
    layout = ShardingLayout.from_dict(schema)
    with pytest.raises(LayoutError) as error:
        layout.validate(num_devices=layout.num_devices, dims=dims)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_what_may_stay_whole_or_replicated_is_accepted() -> None:
    # The built-in layouts keep an odd vocabulary whole, as before; fewer KV heads than
    # shards are replicated (one cache head per shard).
    ShardingLayout.named(tp=4).validate(num_devices=4, dims=DIMS)
    custom = {"mesh": {"t": 4}, "rules": {"vocab": "t", "heads": "t", "kv_heads": "t"}}
    ShardingLayout.from_dict({**custom, "replicate_if_indivisible": ["vocab"]}).validate(dims=DIMS)
    with pytest.raises(LayoutError, match="does not divide the model's 'vocab' \\(49153\\)"):
        ShardingLayout.from_dict(custom).validate(dims=DIMS)


def test_check_layout_refuses_an_array_split_twice_over_one_axis() -> None:
    layout = ShardingLayout.from_dict(
        {"mesh": {"x": 2}, "rules": {"embed": "x", "heads": "x", "kv_heads": "x"}}
    )
    with pytest.raises(XlaserveError) as error:
        check_layout(layout, CFG)
    assert str(error.value) == (
        "sharding layout: 'embed' and 'heads' both map to mesh axis 'x', and wq has both: an "
        "array is split at most once over a mesh axis"
    )


def test_plans_of_two_layouts_on_one_mesh_differ() -> None:
    """The plan (a static argument of every compiled step) holds the layout: layouts that differ
    only in their rules give unequal plans, equal layouts equal ones."""
    a = ShardingLayout.from_dict({"mesh": {"x": 2, "y": 4}, "rules": {"mlp": "x"}})
    b = ShardingLayout.from_dict({"mesh": {"x": 2, "y": 4}, "rules": {"mlp": "y"}})
    mesh = make_mesh(a, jax.devices()[:8])
    assert make_mesh(b, jax.devices()[:8]) == mesh
    cfg = CFG.replace(vocab_size=260)
    plan_a, plan_b = ShardingPlan.create(mesh, cfg, a), ShardingPlan.create(mesh, cfg, b)
    assert plan_a != plan_b
    assert plan_a == ShardingPlan.create(mesh, cfg, ShardingLayout.from_dict(a.to_dict()))
    assert hash(plan_a) == hash(
        ShardingPlan.create(mesh, cfg, ShardingLayout.from_dict(a.to_dict()))
    )


def test_replica_axis_anywhere_in_the_mesh_cuts_disjoint_replicas() -> None:
    layout = ShardingLayout.from_dict(
        {"mesh": {"x": 2, "data": 2, "y": 2}, "rules": {"mlp": "y"}, "replica_axis": "data"}
    )
    mesh = make_mesh(layout, jax.devices()[:8])
    replicas = replica_meshes(mesh, layout)
    assert [dict(m.shape) for m in replicas] == [{"x": 2, "data": 1, "y": 2}] * 2
    held = [set(m.devices.flat) for m in replicas]
    assert held[0].isdisjoint(held[1])
    assert held[0] | held[1] == set(jax.devices()[:8])
    # Replica 0 holds the devices at data index 0 of the (x, data, y) grid.
    assert held[0] == set(mesh.devices[:, 0, :].flat)
    cfg = CFG.replace(vocab_size=260)
    plan = ShardingPlan.create(replicas[1], cfg, layout)
    assert plan.sharding(("embed", "mlp"), (64, 96)).shard_shape((64, 96)) == (64, 48)
