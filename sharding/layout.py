"""Sharding layouts: a device mesh's named axes, and the table from logical axes to them.

Every parameter and KV-cache array names its dimensions with logical axes (`sharding.rules`
lists which); a layout says which mesh axis splits each of them, or that every device holds it
whole. A layout is one hashable value that the compiled step keys on, so steps compiled for one
layout are never reused for another. The built-in `--data/--pipeline/--tensor-parallel-size`
flags are `ShardingLayout.named(dp=, pp=, tp=)`; a layout of one's own comes from Python
(`ShardingLayout.create`) or from a JSON or YAML file (`ShardingLayout.from_file`, schema in
`from_dict`).

Logical axes:
  vocab       the vocabulary: rows of the embedding and of the output layer
  embed       the model's hidden width (every weight has it)
  heads       query heads: wq, wo and the query bias
  kv_heads    key/value heads: wk, wv and the KV cache's head axis; sharded like `heads`. With
              fewer KV heads than shards, K/V projections are replicated and the cache keeps one
              KV head per shard, the one its query heads use
  mlp         the MLP's intermediate width
  layers      the stacked decoder layers, split into pipeline stages: the pipeline axis's only
              use, and that axis shards nothing else
  head_dim, pages, page_slots   within a head, and the KV cache's pages and slots: never split
              (attention contracts over head_dim, and any page may hold any sequence)
  expert      the experts of a mixture of experts (their weights' leading axis): each device
              runs the tokens routed to its experts (`ShardingPlan.shard_experts`)

Pure: no JAX, no engine (engine/config.py holds a layout). Errors are `LayoutError`, a
ValueError of one line that names the axis and the numbers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOGICAL_AXES = (
    "vocab",
    "embed",
    "heads",
    "kv_heads",
    "head_dim",
    "mlp",
    "layers",
    "pages",
    "page_slots",
    "expert",
)
NEVER_SHARDED = ("head_dim", "pages", "page_slots")
_FILE_KEYS = ("mesh", "rules", "replica_axis", "pipeline_axis", "replicate_if_indivisible")


class LayoutError(ValueError):
    """A layout that cannot be used; the message is one line naming the axis and the numbers."""


@dataclass(frozen=True)
class ShardingLayout:
    """A mesh's axes and the logical-axis rules; validated on creation, hashable.

    mesh: (axis name, size) pairs, outermost first; the innermost axis gets neighbouring
        devices (one host, fast links), so it suits the axis that communicates most.
    rules: (logical axis, mesh axis) pairs for the logical axes that are split, in
        LOGICAL_AXES order (`create` sorts them); a logical axis absent here is replicated.
    replica_axis: the mesh axis that separates independent engine replicas (data
        parallelism: each has its own scheduler and KV cache); no array is split over it.
    pipeline_axis: the mesh axis of pipeline stages; `layers` is split over it and nothing else.
    replicate_if_indivisible: logical axes left whole where their mesh axis does not divide
        the model's dimension, instead of refusing the layout (the built-in layouts do this for
        odd vocabularies such as 49,153).
    """

    mesh: tuple[tuple[str, int], ...]
    rules: tuple[tuple[str, str], ...] = ()
    replica_axis: str | None = None
    pipeline_axis: str | None = None
    replicate_if_indivisible: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        self._check_mesh()
        self._check_rules()
        roles = {"replica_axis": self.replica_axis, "pipeline_axis": self.pipeline_axis}
        for role, axis in roles.items():
            if axis is not None and axis not in self.axis_names:
                raise LayoutError(f"{role} {axis!r} is not a mesh axis ({self._mesh_text()})")
        if self.replica_axis is not None and self.replica_axis == self.pipeline_axis:
            raise LayoutError(
                f"mesh axis {self.replica_axis!r} cannot be both the replica and the pipeline axis"
            )
        for logical, axis in self.rules:
            self._check_rule(logical, axis)
        unknown = sorted(set(self.replicate_if_indivisible) - set(LOGICAL_AXES))
        if unknown:
            raise LayoutError(f"replicate_if_indivisible names unknown logical axes {unknown}")

    # ---- construction -----------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        mesh: Mapping[str, int],
        rules: Mapping[str, str | None],
        *,
        replica_axis: str | None = None,
        pipeline_axis: str | None = None,
        replicate_if_indivisible: Iterable[str] = (),
    ) -> ShardingLayout:
        """A layout from a mesh {axis: size} (outermost first) and rules {logical axis: mesh
        axis or None}. `layers` follows `pipeline_axis` and need not be given."""
        unknown = [name for name in rules if name not in LOGICAL_AXES]
        if unknown:
            raise LayoutError(
                f"rule for unknown logical axis {unknown[0]!r}; the logical axes are "
                f"{', '.join(LOGICAL_AXES)}"
            )
        given = dict(rules)
        layers = given.pop("layers", pipeline_axis)
        if layers != pipeline_axis:
            raise LayoutError(
                f"rule 'layers' -> {layers!r} differs from pipeline_axis {pipeline_axis!r}: "
                "the layers are split into pipeline stages, so both name the same axis"
            )
        given["layers"] = pipeline_axis
        ordered = tuple(
            (name, axis) for name in LOGICAL_AXES if (axis := given.get(name)) is not None
        )
        return cls(
            mesh=tuple(mesh.items()),
            rules=ordered,
            replica_axis=replica_axis,
            pipeline_axis=pipeline_axis,
            replicate_if_indivisible=frozenset(replicate_if_indivisible),
        )

    @classmethod
    def named(cls, *, dp: int = 1, pp: int = 1, tp: int = 1) -> ShardingLayout:
        """The built-in layout of --data-, --pipeline- and --tensor-parallel-size: mesh
        (dp, pp, tp); tensor parallelism splits heads, KV heads, the MLP and the vocabulary
        (kept whole where tp does not divide it), the pipeline splits the layers."""
        for flag, size in (("data", dp), ("pipeline", pp), ("tensor", tp)):
            if size < 1:
                raise LayoutError(f"--{flag}-parallel-size must be >= 1, got {size}")
        return cls.create(
            {"dp": dp, "pp": pp, "tp": tp},
            {"vocab": "tp", "heads": "tp", "kv_heads": "tp", "mlp": "tp"},
            replica_axis="dp",
            pipeline_axis="pp",
            replicate_if_indivisible=("vocab",),
        )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ShardingLayout:
        """A layout from its file schema (JSON shown; YAML has the same keys):

        {"mesh": {"data": 1, "x": 2, "y": 4},      # axis -> size, outermost first
         "rules": {"mlp": "x", "vocab": "x",        # logical axis -> mesh axis or null;
                   "heads": "y", "kv_heads": "y"},  #   absent: replicated
         "replica_axis": "data",                    # optional: data-parallel replicas
         "pipeline_axis": null,                     # optional: pipeline stages (layers)
         "replicate_if_indivisible": []}            # optional: logical axes
        """
        if not isinstance(d, Mapping):
            raise LayoutError(f"a layout is a mapping with keys {', '.join(_FILE_KEYS)}")
        extra = sorted(set(d) - set(_FILE_KEYS))
        if extra:
            raise LayoutError(
                f"unknown layout key {extra[0]!r}; the keys are {', '.join(_FILE_KEYS)}"
            )
        mesh, rules = d.get("mesh"), d.get("rules", {})
        if not isinstance(mesh, Mapping) or not mesh:
            raise LayoutError('"mesh" must map mesh axis names to sizes, e.g. {"x": 2, "y": 4}')
        if not isinstance(rules, Mapping):
            raise LayoutError('"rules" must map logical axes to mesh axes, e.g. {"mlp": "x"}')
        indivisible = d.get("replicate_if_indivisible", [])
        if isinstance(indivisible, str) or not isinstance(indivisible, list):
            raise LayoutError('"replicate_if_indivisible" must be a list of logical axes')
        return cls.create(
            mesh,
            rules,
            replica_axis=d.get("replica_axis"),
            pipeline_axis=d.get("pipeline_axis"),
            replicate_if_indivisible=indivisible,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ShardingLayout:
        """A layout from a .json, .yaml or .yml file holding `from_dict`'s schema; errors name
        the file."""
        path = Path(path)
        try:
            return cls.from_dict(_read(path))
        except LayoutError as e:
            raise LayoutError(f"{path}: {e}") from e

    def to_dict(self) -> dict[str, Any]:
        """The file schema of this layout (`from_dict(layout.to_dict()) == layout`)."""
        return {
            "mesh": dict(self.mesh),
            "rules": dict(self.rules),
            "replica_axis": self.replica_axis,
            "pipeline_axis": self.pipeline_axis,
            "replicate_if_indivisible": sorted(self.replicate_if_indivisible),
        }

    # ---- reading ----------------------------------------------------------------------------

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.mesh)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.mesh)

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    @property
    def num_replicas(self) -> int:
        """Independent engine replicas: the replica axis's size (1 without one)."""
        return 1 if self.replica_axis is None else self.axis_size(self.replica_axis)

    def axis_size(self, axis: str) -> int:
        return dict(self.mesh)[axis]

    def rule(self, logical: str) -> str | None:
        """The mesh axis that splits `logical`, or None (replicated)."""
        return dict(self.rules).get(logical)

    def describe(self) -> str:
        """One line for logs: the mesh and the rules."""
        mesh = " x ".join(f"{name}={size}" for name, size in self.mesh)
        rules = ", ".join(f"{logical}->{axis}" for logical, axis in self.rules) or "replicated"
        return f"mesh {mesh}; {rules}"

    # ---- validation -------------------------------------------------------------------------

    def validate(
        self, *, num_devices: int | None = None, dims: Mapping[str, int] | None = None
    ) -> None:
        """Refuses (LayoutError) a layout whose axis sizes do not multiply to `num_devices`, or
        that splits one of the model's `dims` ({logical axis: size}) over a mesh axis that does
        not divide it (kv_heads: the two must divide one another), or that splits a logical
        axis the model does not have."""
        if num_devices is not None and self.num_devices != num_devices:
            raise LayoutError(
                f"the mesh {self._mesh_text()} has {self.num_devices} devices, but there are "
                f"{num_devices}: the axis sizes must multiply to the device count"
            )
        if dims is not None:
            for logical, axis in self.rules:
                self._check_dim(logical, axis, dims)

    def _check_dim(self, logical: str, axis: str, dims: Mapping[str, int]) -> None:
        if logical not in dims:
            raise LayoutError(f"rule {logical!r} -> {axis!r}: the model has no {logical!r} axis")
        size, dim = self.axis_size(axis), dims[logical]
        if dim % size == 0 or logical in self.replicate_if_indivisible:
            return
        if logical == "kv_heads" and size % dim == 0:
            return  # fewer KV heads than shards: replicated projections, one cache head each
        raise LayoutError(
            f"mesh axis {axis!r} of size {size} does not divide the model's {logical!r} "
            f"({dim}); choose a size that divides {dim}, or leave {logical!r} replicated"
        )

    def _check_mesh(self) -> None:
        names = self.axis_names
        if not names:
            raise LayoutError("the mesh needs at least one axis")
        for name, size in self.mesh:
            if not isinstance(name, str) or not name:
                raise LayoutError(f"mesh axis names must be non-empty strings, got {name!r}")
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise LayoutError(f"mesh axis {name!r} must have a size >= 1, got {size!r}")
        if len(set(names)) != len(names):
            raise LayoutError(f"mesh axis names repeat: {list(names)}")

    def _check_rules(self) -> None:
        logicals = [logical for logical, _ in self.rules]
        for logical in logicals:
            if logical not in LOGICAL_AXES:
                raise LayoutError(
                    f"rule for unknown logical axis {logical!r}; the logical axes are "
                    f"{', '.join(LOGICAL_AXES)}"
                )
        canonical = [name for name in LOGICAL_AXES if name in logicals]
        if logicals != canonical:
            raise LayoutError(
                "rules must list each logical axis once, in LOGICAL_AXES order "
                "(ShardingLayout.create sorts them)"
            )
        if self.rule("layers") != self.pipeline_axis:
            raise LayoutError(
                f"rule 'layers' -> {self.rule('layers')!r} differs from pipeline_axis "
                f"{self.pipeline_axis!r}: the layers are split into pipeline stages"
            )
        if self.rule("heads") != self.rule("kv_heads"):
            raise LayoutError(
                f"'kv_heads' -> {self.rule('kv_heads')!r} must be split like 'heads' -> "
                f"{self.rule('heads')!r}: each shard attends with its query heads' KV heads"
            )

    def _check_rule(self, logical: str, axis: str) -> None:
        if not isinstance(axis, str) or axis not in self.axis_names:
            raise LayoutError(
                f"rule {logical!r} -> {axis!r} names no mesh axis; the mesh is {self._mesh_text()}"
            )
        if logical in NEVER_SHARDED:
            raise LayoutError(
                f"rule {logical!r} -> {axis!r}: {logical!r} cannot be split (attention "
                "contracts over head_dim and reads any page); leave it out"
            )
        if axis == self.replica_axis:
            raise LayoutError(
                f"rule {logical!r} -> {axis!r}: the replica axis separates engine replicas and "
                "splits no array"
            )
        if axis == self.pipeline_axis and logical != "layers":
            raise LayoutError(
                f"rule {logical!r} -> {axis!r}: the pipeline axis splits only 'layers' (stages)"
            )

    def _mesh_text(self) -> str:
        return " x ".join(f"{name}={size}" for name, size in self.mesh)


def _read(path: Path) -> Any:
    if not path.is_file():
        raise LayoutError("no such file")
    text = path.read_text()
    if path.suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise LayoutError(f"not valid JSON: {e}") from e
    if path.suffix in (".yaml", ".yml"):
        return _read_yaml(text)
    raise LayoutError(f"a layout file ends in .json, .yaml or .yml, not {path.suffix!r}")


def _read_yaml(text: str) -> Any:
    try:
        import yaml
    except ImportError as e:
        raise LayoutError(
            "reading a YAML layout needs the PyYAML package (pip install pyyaml); or write the "
            "layout as .json"
        ) from e
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise LayoutError(f"not valid YAML: {' '.join(str(e).split())}") from e
