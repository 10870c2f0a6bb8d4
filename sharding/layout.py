"""TEMPORARY stub of the layout helper's API (replaced on merge)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ShardingLayout:
    mesh: tuple[tuple[str, int], ...] = (("dp", 1), ("pp", 1), ("tp", 1))

    @classmethod
    def named(cls, *, dp: int = 1, pp: int = 1, tp: int = 1) -> ShardingLayout:
        return cls((("dp", dp), ("pp", pp), ("tp", tp)))

    @classmethod
    def from_file(cls, path: str | Path) -> ShardingLayout:
        raise NotImplementedError

    @classmethod
    def from_dict(cls, d: Any) -> ShardingLayout:
        raise NotImplementedError

    @property
    def num_replicas(self) -> int:
        return dict(self.mesh)["dp"]

    @property
    def num_devices(self) -> int:
        n = 1
        for _, size in self.mesh:
            n *= size
        return n
