"""The device mesh of a sharding layout: its named axes over the devices.

Axes are laid out outermost first, as the layout lists them. The innermost axis gets
neighbouring devices of one host (on TPU, `mesh_utils` orders them along the chips' fastest
links), so a layout puts there the axis that talks most: the built-in layouts' (dp, pp, tp) puts
tensor parallelism (collectives at every layer) inside, pipeline stages (once per micro-batch)
and replicas (never) outside, where they may span hosts.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from engine.errors import XlaserveError
from sharding.layout import LayoutError, ShardingLayout


def make_mesh(layout: ShardingLayout, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The layout's mesh over `devices` (default: every process's devices), which must number
    exactly `layout.num_devices`. Axes are `Auto`: XLA inserts the collectives of sharded
    matmuls."""
    devices = list(jax.devices() if devices is None else devices)
    try:
        layout.validate(num_devices=len(devices))
    except LayoutError as e:
        raise XlaserveError(f"sharding layout: {e}") from e
    grid = _device_grid(layout, devices)
    names = layout.axis_names
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def _device_grid(layout: ShardingLayout, devices: list[jax.Device]) -> np.ndarray:
    """Devices arranged so that the innermost axis stays within a host and on fast links."""
    shape = layout.shape
    processes = {d.process_index for d in devices}
    if len(processes) > 1:
        local = len(devices) // len(processes)
        if shape[-1] > local or local % shape[-1]:
            raise XlaserveError(
                f"mesh axis {layout.axis_names[-1]!r} of size {shape[-1]} must divide the "
                f"{local} devices of each process: the innermost axis stays inside one host"
            )
        ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
        return np.array(ordered, dtype=object).reshape(shape)
    try:  # topology-aware on TPU (ICI rings); a plain reshape elsewhere
        return mesh_utils.create_device_mesh(shape, devices)
    except (AssertionError, NotImplementedError, ValueError):
        return np.array(devices, dtype=object).reshape(shape)


def replica_meshes(mesh: Mesh, layout: ShardingLayout) -> list[Mesh]:
    """One mesh per data-parallel replica (the replica axis cut to size 1); `[mesh]` when the
    layout has no replica axis."""
    if layout.replica_axis is None:
        return [mesh]
    return [
        slice_mesh(mesh, layout.replica_axis, i) for i in range(mesh.shape[layout.replica_axis])
    ]


def slice_mesh(mesh: Mesh, axis: str, index: int) -> Mesh:
    """The devices at `index` along `axis`, as a mesh with the same axes (`axis` of size 1)."""
    devices = np.take(mesh.devices, [index], axis=mesh.axis_names.index(axis))
    return Mesh(devices, mesh.axis_names, axis_types=mesh.axis_types)
