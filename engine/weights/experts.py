"""Mixture-of-experts checkpoints in either layout, seen through the fused one.

transformers 5 holds a layer's experts fused, `mlp.experts.gate_up_proj` [E, 2F, D] (gate rows,
then up rows) and `mlp.experts.down_proj` [E, D, F], with the router at `mlp.gate.weight`; the
checkpoints people download (and what `save_pretrained` writes) have one tensor per expert:
`mlp.experts.{j}.gate_proj/up_proj/down_proj.weight` (Qwen3-MoE, OLMoE) or
`block_sparse_moe.experts.{j}.w1/w3/w2.weight` with the router at `block_sparse_moe.gate.weight`
(Mixtral); a GGUF holds gate and up of all experts apart (`mlp.experts.gate_exps`/`up_exps`
[E, F, D] under the names `gguf_file` gives them). `FusedExperts` shows a source of any of
these kinds under the fused names, stacking or joining the tensors when one is read, so the
model's tensor specs name one layout.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from engine.weights.quantize import HostQuantized

# per-expert name pattern (layer prefix, expert index) -> which part: 0 gate, 1 up, 2 down
_PER_EXPERT = (
    (re.compile(r"(.*)\.mlp\.experts\.(\d+)\.gate_proj\.weight"), 0),
    (re.compile(r"(.*)\.mlp\.experts\.(\d+)\.up_proj\.weight"), 1),
    (re.compile(r"(.*)\.mlp\.experts\.(\d+)\.down_proj\.weight"), 2),
    (re.compile(r"(.*)\.block_sparse_moe\.experts\.(\d+)\.w1\.weight"), 0),
    (re.compile(r"(.*)\.block_sparse_moe\.experts\.(\d+)\.w3\.weight"), 1),
    (re.compile(r"(.*)\.block_sparse_moe\.experts\.(\d+)\.w2\.weight"), 2),
)
_MIXTRAL_ROUTER = re.compile(r"(.*)\.block_sparse_moe\.gate\.weight")
_GGUF_GATE = re.compile(r"(.*)\.mlp\.experts\.gate_exps")


class FusedExperts:
    """A tensor source (`engine.weights.TensorSource`) whose per-expert tensors appear stacked
    under the fused names; every other tensor passes through."""

    def __init__(self, source: Any):
        self._source = source
        # fused name -> the per-expert names it stacks: [gate names, up names] or [down names]
        self._stacks: dict[str, list[list[str]]] = {}
        self._concats: dict[str, tuple[str, str]] = {}  # gate_up_proj -> (gate_exps, up_exps)
        self._renamed: dict[str, str] = {}  # fused-layout name -> the checkpoint's name
        parts: dict[tuple[str, int], dict[int, str]] = {}
        for name in source.names():
            if router := _MIXTRAL_ROUTER.fullmatch(name):
                self._renamed[f"{router.group(1)}.mlp.gate.weight"] = name
            if gate := _GGUF_GATE.fullmatch(name):
                up = f"{gate.group(1)}.mlp.experts.up_exps"
                self._concats[f"{gate.group(1)}.mlp.experts.gate_up_proj"] = (name, up)
            for pattern, part in _PER_EXPERT:
                if match := pattern.fullmatch(name):
                    parts.setdefault((match.group(1), part), {})[int(match.group(2))] = name
        for (layer, part), by_expert in parts.items():
            names = [by_expert[j] for j in sorted(by_expert)]
            if part == 2:
                self._stacks[f"{layer}.mlp.experts.down_proj"] = [names]
            else:
                gate_up = self._stacks.setdefault(f"{layer}.mlp.experts.gate_up_proj", [[], []])
                gate_up[part] = names
        self._hidden = {n for groups in self._stacks.values() for g in groups for n in g}
        self._hidden |= set(self._renamed.values())
        self._hidden |= {n for pair in self._concats.values() for n in pair}

    def names(self) -> set[str]:
        fused = set(self._stacks) | set(self._renamed) | set(self._concats)
        return (self._source.names() - self._hidden) | fused

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._renamed:
            return self._source.shape(self._renamed[name])
        if name in self._concats:
            experts, rows, cols = self._source.shape(self._concats[name][0])
            return (experts, 2 * rows, cols)
        if name not in self._stacks:
            return self._source.shape(name)
        groups = self._stacks[name]
        rows, cols = self._source.shape(groups[0][0])
        return (len(groups[0]), rows * len(groups), cols)

    def get(self, name: str) -> np.ndarray:
        if name in self._renamed:
            return self._source.get(self._renamed[name])
        if name in self._concats:
            return np.concatenate([self._source.get(n) for n in self._concats[name]], axis=1)
        if name not in self._stacks:
            return self._source.get(name)
        stacked = [np.stack([self._source.get(n) for n in group]) for group in self._stacks[name]]
        return np.concatenate(stacked, axis=1)  # [E, F, D] x2 -> [E, 2F, D]; down as it is

    def get_blocks(self, name: str, bits: int) -> HostQuantized | None:
        """A GGUF's stored blocks (`gguf_file.GGUFTensors.get_blocks`), gate and up joined like
        `get` joins them; None where the tensors are not taken as stored (per-expert
        safetensors have no blocks; gate and up of different block types are quantized again
        from float)."""
        if name in self._renamed:
            return self._source.get_blocks(self._renamed[name], bits)
        if name in self._stacks:
            return None
        if name not in self._concats:
            return self._source.get_blocks(name, bits)
        gate, up = (self._source.get_blocks(n, bits) for n in self._concats[name])
        if gate is None or up is None or gate.bits != up.bits:
            return None
        if (gate.offsets is None) != (up.offsets is None):
            return None
        offsets = None
        if gate.offsets is not None and up.offsets is not None:
            offsets = np.concatenate([gate.offsets, up.offsets], axis=1)
        return HostQuantized(
            np.concatenate([gate.values, up.values], axis=1),  # [E, F, D] x2 -> [E, 2F, D]
            np.concatenate([gate.scales, up.scales], axis=1),
            offsets,
            gate.bits,
        )
