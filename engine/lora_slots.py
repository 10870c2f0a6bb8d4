"""The LoRA adapters' device slots: one stacked array per projection and layer (slot 0 all zeros,
the base model), placed as the sharding plan splits the base weights, and the one compiled
function that writes an adapter into a slot. Writing is a functional update of the arrays that
the step takes as arguments, so loading or swapping adapters compiles nothing.

Boundary code: moves adapters from the host into device slots.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from engine.config import LoRAConfig, ModelConfig
from engine.errors import XlaserveError
from engine.lora import LoRAAdapter, empty_slot
from engine.models.layers import Params, stack_layers
from sharding.rules import ShardingPlan


def _write(weights: Any, new: Any, slot: jax.Array, *, axis: int) -> Any:
    """`weights` with slot `slot` (along `axis`) replaced by `new`, whose leaves lack that axis."""
    return jax.tree.map(
        lambda w, n: jax.lax.dynamic_update_index_in_dim(w, n.astype(w.dtype), slot, axis),
        weights,
        new,
    )


class LoRASlots:
    """The slots' arrays (`weights`, as `engine.models.lora.LoRAInputs` takes them) and `write`."""

    def __init__(
        self,
        config: LoRAConfig,
        cfg: ModelConfig,
        params: Params,
        plan: ShardingPlan | None,
    ):
        if plan is not None and plan.num_stages > 1:
            raise XlaserveError("LoRA adapters with pipeline parallelism are not supported yet")
        self.dtype = np.float32 if cfg.dtype == "float32" else jax.numpy.bfloat16
        self.stacked = not isinstance(params["layers"], list)
        self.plan = plan
        one = empty_slot(cfg, config.max_lora_rank, self.dtype)
        host = [
            {key: np.repeat(w[None], config.num_slots, axis=0) for key, w in layer.items()}
            for layer in one
        ]
        self.weights = self._place(stack_layers(host) if self.stacked else host)
        shardings = None if plan is None else jax.tree.map(lambda x: x.sharding, self.weights)
        axis = 1 if self.stacked else 0  # stacked: [layers, slots, ...]
        self._write = jax.jit(functools.partial(_write, axis=axis), out_shardings=shardings)
        self.write(0, one)  # compiles the write now, at start-up; slot 0 stays zeros

    def _place(self, tree: Any) -> Any:
        if self.plan is None:
            return jax.device_put(tree)
        return jax.device_put(tree, self.plan.param_shardings(tree))

    def write(self, slot: int, layers: list[dict[str, np.ndarray]]) -> None:
        """Puts one slot's weights (per layer, engine layout, padded to the maximum rank)."""
        new: Any = [{k: np.asarray(v, self.dtype) for k, v in layer.items()} for layer in layers]
        if self.stacked:
            new = {k: np.stack([layer[k] for layer in new]) for k in new[0]}
        placed = jax.device_put(new) if self.plan is None else jax.device_put(
            new, self.plan.replicated
        )  # fmt: skip
        index = np.int32(slot)
        self.weights = self._write(self.weights, placed, index)

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        self.write(slot, adapter.weights)
