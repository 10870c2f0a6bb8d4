"""The device mesh: named axes for data, pipeline and tensor parallelism.

Axes, outermost first: `dp` (independent engine replicas), `pp` (pipeline stages), `tp` (tensor
parallelism). Tensor parallelism talks at every layer, pipeline stages once per micro-batch and
replicas never, so `tp` is the innermost axis: its groups are neighbouring devices of one host
(on TPU, `mesh_utils` orders them along the chips' fastest links), and only `pp` and `dp` span
hosts.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from engine.errors import XlaserveError

AXES = ("dp", "pp", "tp")


def make_mesh(
    dp: int = 1, tp: int = 1, pp: int = 1, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A (dp, pp, tp) mesh over `devices` (default: every process's devices), which must number
    exactly dp * pp * tp. Axes are `Auto`: XLA inserts the collectives of sharded matmuls."""
    devices = list(jax.devices() if devices is None else devices)
    for name, size in (("data", dp), ("tensor", tp), ("pipeline", pp)):
        if size < 1:
            raise XlaserveError(f"--{name}-parallel-size must be >= 1, got {size}")
    if dp * pp * tp != len(devices):
        raise XlaserveError(
            f"data x pipeline x tensor parallel sizes {dp} x {pp} x {tp} = {dp * pp * tp} must "
            f"equal the number of devices, {len(devices)}"
        )
    grid = _device_grid((dp, pp, tp), devices)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def _device_grid(shape: tuple[int, int, int], devices: list[jax.Device]) -> np.ndarray:
    """Devices arranged so that the last axis (tp) stays within a host and on fast links."""
    processes = {d.process_index for d in devices}
    if len(processes) > 1:
        local = len(devices) // len(processes)
        if shape[-1] > local or local % shape[-1]:
            raise XlaserveError(
                f"tensor parallel size {shape[-1]} must divide the {local} devices of each "
                "process: tensor-parallel groups stay inside one host"
            )
        ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
        return np.array(ordered, dtype=object).reshape(shape)
    try:  # topology-aware on TPU (ICI rings); a plain reshape elsewhere
        return mesh_utils.create_device_mesh(shape, devices)
    except (AssertionError, NotImplementedError, ValueError):
        return np.array(devices, dtype=object).reshape(shape)


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One (1, pp, tp) mesh per data-parallel replica."""
    return [
        Mesh(mesh.devices[i : i + 1], AXES, axis_types=mesh.axis_types)
        for i in range(mesh.shape["dp"])
    ]


def axis_size(mesh: Mesh | None, name: str) -> int:
    return 1 if mesh is None else int(mesh.shape[name])
