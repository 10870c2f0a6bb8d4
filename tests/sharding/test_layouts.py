"""Custom sharding layouts, given as files, against the single-device engine (the oracle):
greedy tokens identical and logits within 1e-5; every parameter split exactly as the file says
(read from the arrays' shards, not from the plan); invalid layouts refused at start-up with one
line; and a second layout on the same mesh compiles its own steps."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from engine import compilation
from engine.errors import XlaserveError
from engine.llm_engine import LLMEngine
from sharding.layout import LayoutError, ShardingLayout
from sharding.mesh import make_mesh
from tests.sharding.conftest import (
    assert_same,
    assert_same_logits,
    build_engine,
    generate,
    prefill_logits,
)

# The tiny model: vocab 260, hidden 64, MLP 96, 4 heads and 2 KV heads of 16, 2 layers.
# MLP and vocabulary over one axis of 2, heads over another of 4 (the built-in layouts put all
# of them on one axis).
LAYOUT_JSON = """{
  "mesh": {"x": 2, "y": 4},
  "rules": {"mlp": "x", "vocab": "x", "heads": "y", "kv_heads": "y"}
}"""
# The same mesh, other rules: two pipeline stages over x, the rest over y.
LAYOUT_YAML = """
mesh: {x: 2, y: 4}
pipeline_axis: x
rules: {heads: y, kv_heads: y, mlp: y, vocab: y}
"""
# Parts each parameter is cut into, by dimension, written out by hand from the files above
# (no entry: whole on every device). With 2 KV heads and 4 shards of heads, wk and wv stay
# whole and each shard's cache holds one KV head, the one its query heads use.
SPLITS_JSON = {
    "embed": {0: 2},  # [V, D]
    "lm_head": {0: 2},
    "w_gate": {1: 2},  # [D, F]
    "w_up": {1: 2},
    "w_down": {0: 2},  # [F, D]
    "wq": {1: 4},  # [D, N, H]
    "wo": {0: 4},  # [N, H, D]
}
CACHE_SPLITS_JSON = {2: 4}  # [pages, page_size, 2 * 4 cache heads, H]: one K/V pair each
SPLITS_YAML = {  # the layers are stacked [L, ...] for the pipeline
    "embed": {0: 4},
    "lm_head": {0: 4},
    "w_gate": {0: 2, 2: 4},
    "w_up": {0: 2, 2: 4},
    "w_down": {0: 2, 1: 4},
    "wq": {0: 2, 2: 4},
    "wo": {0: 2, 1: 4},
    "wk": {0: 2},
    "wv": {0: 2},
    "attn_norm": {0: 2},
    "mlp_norm": {0: 2},
}
CACHE_SPLITS_YAML = {0: 2, 3: 4}  # [L, pages, page_size, 8, H]


def file_layout(tmp_path: Path, name: str, text: str) -> ShardingLayout:
    path = tmp_path / name
    path.write_text(text)
    return ShardingLayout.from_file(path)


@pytest.fixture(scope="module")
def json_engine(tiny, tmp_path_factory) -> LLMEngine:
    layout = file_layout(tmp_path_factory.mktemp("layout"), "layout.json", LAYOUT_JSON)
    return build_engine(tiny, layout=layout)


def assert_split(name: str, x: jax.Array, splits: dict[int, int]) -> None:
    """Every device holds a block of x cut into `splits` parts along those dimensions, and the
    blocks differ: a split array, not a replicated one."""
    block = tuple(n // splits.get(d, 1) for d, n in enumerate(x.shape))
    shards = x.addressable_shards
    assert {s.data.shape for s in shards} == {block}, f"{name} {x.shape}: {x.sharding}"
    starts = {tuple(i.start or 0 for i in s.index) for s in shards}
    assert len(starts) == int(np.prod(list(splits.values()), dtype=int)), name


def assert_params_split(engine: LLMEngine, splits: dict[str, dict[int, int]]) -> None:
    leaves = jax.tree_util.tree_leaves_with_path(engine.runner.params)
    assert {str(path[-1].key) for path, _ in leaves} >= set(splits)
    for path, x in leaves:
        name = str(path[-1].key)
        assert_split(jax.tree_util.keystr(path), x, splits.get(name, {}))


def test_json_layout_file_matches_single_device(json_engine, single_device) -> None:
    assert_same_logits(prefill_logits(json_engine), single_device[0])
    assert_same(generate(json_engine), single_device[1])
    assert_params_split(json_engine, SPLITS_JSON)
    for cache in json_engine.runner.kv_caches:
        assert_split("cache", cache, CACHE_SPLITS_JSON)


def test_another_layout_on_the_same_mesh_compiles_its_own_steps(
    tiny, json_engine, single_device, tmp_path
) -> None:
    """The YAML layout has the JSON one's mesh (axis names and sizes) and other rules: its steps
    must be compiled for it, never taken from the JSON layout's."""
    layout = file_layout(tmp_path, "layout.yaml", LAYOUT_YAML)
    assert layout.axis_names == json_engine.runner.plan.layout.axis_names
    engine = build_engine(tiny, layout=layout)
    assert engine.runner.plan.mesh == json_engine.runner.plan.mesh
    assert engine.runner.options() != json_engine.runner.options()

    before = compilation.count()
    got = generate(engine)
    compiled = compilation.count() - before
    print(f"{compiled} compilations for {engine.runner.num_compiled} steps")
    assert compiled == engine.runner.num_compiled > 0
    assert_same(got, single_device[1])
    assert_params_split(engine, SPLITS_YAML)
    assert_split("cache", engine.runner.kv_caches, CACHE_SPLITS_YAML)


def test_python_layout_splits_the_hidden_width(tiny, single_device) -> None:
    """The hidden width (every weight's `embed` axis) over its own axis, with a pipeline and
    heads, MLP and vocabulary over a third: prefill logits as on one device."""
    layout = ShardingLayout.create(
        {"stage": 2, "fsdp": 2, "model": 2},
        {"embed": "fsdp", "heads": "model", "kv_heads": "model", "mlp": "model", "vocab": "model"},
        pipeline_axis="stage",
    )
    engine = build_engine(tiny, layout=layout)
    assert_same_logits(prefill_logits(engine), single_device[0])
    params = engine.runner.params
    assert_split("embed", params["embed"], {0: 2, 1: 2})
    assert_split("wq", params["layers"]["wq"], {0: 2, 1: 2, 2: 2})
    assert_split("final_norm", params["final_norm"], {0: 2})


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (
            {"mesh": {"x": 8}, "rules": {"heads": "x", "kv_heads": "x"}},
            "mesh axis 'x' of size 8 does not divide the model's 'heads' (4)",
        ),
        (
            {"mesh": {"x": 2, "y": 4}, "rules": {"vocab": "y", "mlp": "x", "embed": "x"}},
            "'embed' and 'mlp' both map to mesh axis 'x'",
        ),
        (
            {"mesh": {"x": 8}, "rules": {"vocab": "x"}},
            "mesh axis 'x' of size 8 does not divide the model's 'vocab' (260)",
        ),
    ],
    ids=["heads", "collision", "vocab"],
)
def test_layout_that_cannot_shard_the_model_is_refused_at_start_up(tiny, layout, message) -> None:
    with pytest.raises(XlaserveError) as error:
        build_engine(tiny, layout=ShardingLayout.from_dict(layout))
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_layout_of_another_device_count_is_refused() -> None:
    layout = ShardingLayout.from_dict({"mesh": {"x": 2, "y": 3}, "rules": {"mlp": "x"}})
    with pytest.raises(XlaserveError) as error:
        make_mesh(layout)  # every device: 8
    assert str(error.value) == (
        "sharding layout: the mesh x=2 x y=3 has 6 devices, but there are 8: the axis sizes "
        "must multiply to the device count"
    )


def test_layout_file_with_an_unknown_logical_axis_is_refused(tmp_path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"mesh": {"x": 8}, "rules": {"mlp": "x", "experts": "x"}}')
    with pytest.raises(LayoutError) as error:
        ShardingLayout.from_file(path)
    assert str(error.value).startswith(f"{path}: rule for unknown logical axis 'experts'")
    assert "\n" not in str(error.value)
