"""LoRA adapters on the host: reading PEFT's format, checking it against the model, and deciding
which adapter sits in which device slot.

An adapter directory holds `adapter_config.json` (r, lora_alpha, use_rslora, target_modules)
and `adapter_model.safetensors` (`...layers.{i}.self_attn.q_proj.lora_A.weight` f[r, in] and
`...lora_B.weight` f[out, r]). PEFT's product is x @ A.T @ B.T * scaling, with scaling
alpha / r, or alpha / sqrt(r) with rsLoRA. Each file is read once; the bytes read are the ones
checked, converted and hashed (the hash is the adapter's prefix-cache salt), so nothing that was
not checked reaches a device slot.

Registered adapters are known by name (`LoRARegistry`); at most `max_cpu_loras` of them are kept
parsed on the host (least recently used dropped first, read again when needed) and `max_loras`
sit in device slots 1..max_loras (slot 0 is the base model). A slot is taken back, least
recently used first, only from an adapter that no running request uses.

Host code: NumPy, no JAX (the model runner writes the slots).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from safetensors.numpy import load as load_safetensors

from engine.config import LORA_TARGET_MODULES, LoRAConfig, ModelConfig
from engine.errors import InvalidRequestError

log = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT module name -> the engine's projection (engine/models/lora.py TARGETS)
PROJECTIONS = {
    "q_proj": "wq",
    "k_proj": "wk",
    "v_proj": "wv",
    "o_proj": "wo",
    "gate_proj": "w_gate",
    "up_proj": "w_up",
    "down_proj": "w_down",
}
_TENSOR = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)


class LoRAError(InvalidRequestError):
    """An adapter that cannot be served as given (one line naming the problem); a 400."""

    def __init__(self, message: str):
        super().__init__(message, param="lora_path")


@dataclass(frozen=True)
class LoRARequest:
    """Which adapter a request runs with (vLLM's offline `LoRARequest`): registered under
    `name` from `path` on first use. `lora_int_id` is accepted for vLLM's signature; names
    identify adapters here."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


@dataclass(frozen=True)
class LoRAAdapter:
    """One checked adapter in the engine's layout, padded to the maximum rank: per layer, for
    every projection, A f[In..., R] and B f[R, Out...] (scaling folded into B; zeros for the
    projections it does not adapt)."""

    name: str
    path: str
    rank: int
    digest: bytes  # SHA-256 of its config and weights as read: the prefix-cache salt
    weights: list[dict[str, np.ndarray]]


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each projection's input and output axes in the engine's layout (engine/models/llama.py)."""
    d, f, n, k, h = (
        cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
    )  # fmt: skip
    return {
        "wq": ((d,), (n, h)),
        "wk": ((d,), (k, h)),
        "wv": ((d,), (k, h)),
        "wo": ((n, h), (d,)),
        "w_gate": ((d,), (f,)),
        "w_up": ((d,), (f,)),
        "w_down": ((f,), (d,)),
    }


def empty_slot(cfg: ModelConfig, rank: int, dtype: Any) -> list[dict[str, np.ndarray]]:
    """One slot's weights, all zeros (the base model); every array its own."""
    shapes = projection_shapes(cfg)

    def layer() -> dict[str, np.ndarray]:
        arrays = {}
        for target, (inputs, outputs) in shapes.items():
            arrays[f"{target}_lora_a"] = np.zeros((*inputs, rank), dtype)
            arrays[f"{target}_lora_b"] = np.zeros((rank, *outputs), dtype)
        return arrays

    return [layer() for _ in range(cfg.num_layers)]


# ---- reading and checking -------------------------------------------------------------------


def check_allowed(path: str, allowed_dirs: Iterable[str]) -> str:
    """The adapter directory `path` resolved (symlinks and `..` followed), if it lies inside
    one of `allowed_dirs`; LoRAError otherwise."""
    real = os.path.realpath(path)
    for allowed in allowed_dirs:
        root = os.path.realpath(allowed)
        if os.path.commonpath([real, root]) == root:
            return real
    raise LoRAError(f"adapter path {path!r} is not inside the directories allowed for adapters")


def read_adapter(
    name: str,
    path: str,
    cfg: ModelConfig,
    max_rank: int,
    dtype: Any,
    allowed_dirs: Iterable[str] | None = None,
) -> LoRAAdapter:
    """Reads and checks the PEFT adapter in directory `path`; LoRAError names what is wrong.
    With `allowed_dirs`, the directory and both files must resolve inside one of them."""
    files = [os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)]
    if allowed_dirs is not None:
        check_allowed(path, allowed_dirs)
        for file in files:
            check_allowed(file, allowed_dirs)
    config_bytes, weight_bytes = (_read(file, name) for file in files)
    config = _parse_config(config_bytes, name)
    try:
        tensors = load_safetensors(weight_bytes)
    except Exception as e:
        raise LoRAError(f"adapter {name!r}: {WEIGHTS_FILE} is not a safetensors file ({e})") from e
    pairs, rank = _pairs(tensors, cfg, max_rank, name)
    alpha = float(config["lora_alpha"])
    r = int(config["r"])
    if rank != r or any(a.shape[0] != r for a, _ in pairs.values()):
        raise LoRAError(f"adapter {name!r}: its tensors' ranks differ from r={r} in its config")
    scaling = alpha / math.sqrt(r) if config.get("use_rslora", False) else alpha / r
    weights = empty_slot(cfg, max_rank, dtype)
    shapes = projection_shapes(cfg)
    for (layer, target), (a, b) in pairs.items():
        inputs, outputs = shapes[target]
        rows = a.shape[0]
        slot_a, slot_b = weights[layer][f"{target}_lora_a"], weights[layer][f"{target}_lora_b"]
        slot_a[..., :rows] = a.T.reshape(*inputs, rows)
        slot_b[:rows] = (b.T.astype(np.float64) * scaling).reshape(rows, *outputs)
    digest = hashlib.sha256(config_bytes + b"\0" + weight_bytes).digest()
    return LoRAAdapter(name, path, rank, digest, weights)


def _read(file: str, name: str) -> bytes:
    try:
        with open(file, "rb") as f:
            return f.read()
    except OSError as e:
        raise LoRAError(f"adapter {name!r}: cannot read {file}: {e.strerror}") from e


def _parse_config(raw: bytes, name: str) -> dict[str, Any]:
    try:
        config = json.loads(raw)
    except ValueError as e:
        raise LoRAError(f"adapter {name!r}: {CONFIG_FILE} is not JSON ({e})") from e
    if not isinstance(config, dict):
        raise LoRAError(f"adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"adapter {name!r}: peft_type {config['peft_type']!r} is not LORA")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), int | float) or config[key] <= 0:
            raise LoRAError(f"adapter {name!r}: {CONFIG_FILE} needs a positive {key!r}")
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "lora_bias": bool(config.get("lora_bias")),
        "bias": config.get("bias", "none") != "none",
        "modules_to_save": bool(config.get("modules_to_save")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
    }
    for key, used in unsupported.items():
        if used:
            raise LoRAError(f"adapter {name!r}: {key} is not supported")
    targets = config.get("target_modules") or []
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(LORA_TARGET_MODULES))
        if unknown:
            raise LoRAError(
                f"adapter {name!r}: unknown target module {unknown[0]!r} "
                f"(supported: {', '.join(LORA_TARGET_MODULES)})"
            )
    return config


def _pairs(
    tensors: dict[str, np.ndarray], cfg: ModelConfig, max_rank: int, name: str
) -> tuple[dict[tuple[int, str], tuple[np.ndarray, np.ndarray]], int]:
    """{(layer, projection): (A f[r, in], B f[out, r])} checked against the model; the rank."""
    found: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, tensor in tensors.items():
        match = _TENSOR.match(key)
        if match is None:
            raise LoRAError(f"adapter {name!r}: unsupported tensor {key!r}")
        layer, module, which = int(match[1]), match[2], match[3]
        if module not in PROJECTIONS:
            raise LoRAError(f"adapter {name!r}: unknown target module {module!r} in {key!r}")
        if layer >= cfg.num_layers:
            raise LoRAError(f"adapter {name!r}: {key!r} is past the model's last layer")
        found.setdefault((layer, PROJECTIONS[module]), {})[which] = tensor
    if not found:
        raise LoRAError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    shapes = projection_shapes(cfg)
    pairs, rank = {}, 0
    for (layer, target), ab in sorted(found.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"adapter {name!r}: layer {layer} {target} lacks lora_A or lora_B")
        a, b = ab["A"], ab["B"]
        inputs, outputs = (math.prod(s) for s in shapes[target])
        r = a.shape[0]
        if r > max_rank:
            raise LoRAError(
                f"adapter {name!r}: rank {r} is above the maximum LoRA rank {max_rank} "
                "(--max-lora-rank)"
            )
        if a.shape != (r, inputs) or b.shape != (outputs, r):
            raise LoRAError(
                f"adapter {name!r}: layer {layer} {target} has lora_A {a.shape} and lora_B "
                f"{b.shape}; the model needs ({r}, {inputs}) and ({outputs}, {r})"
            )
        pairs[(layer, target)] = (a, b)
        rank = max(rank, r)
    return pairs, rank


# ---- which adapters are known, parsed, and in which slot ------------------------------------


class LoRARegistry:
    """Registered adapters (name -> path), the parsed ones kept on the host (LRU, at most
    `max_cpu_loras`) and the device slots' owners."""

    def __init__(self, config: LoRAConfig, cfg: ModelConfig, dtype: Any):
        self.config, self.cfg, self.dtype = config, cfg, dtype
        self._paths: dict[str, str] = {}
        self._parsed: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._slots: list[str | None] = [None] * config.num_slots  # slot 0: the base model
        self._slot_use: OrderedDict[int, None] = OrderedDict()  # slots 1.., least recent first
        for slot in range(1, config.num_slots):
            self._slot_use[slot] = None
        self.num_loads = 0  # slot writes

    def names(self) -> list[str]:
        return list(self._paths)

    def path(self, name: str) -> str:
        if name not in self._paths:
            raise InvalidRequestError(f"the LoRA adapter {name!r} does not exist", param="model")
        return self._paths[name]

    def add(self, name: str, path: str, *, restricted: bool = False) -> LoRAAdapter:
        """Reads, checks and registers an adapter; with `restricted` its files must lie in the
        configured allowed directories."""
        if not name or name in self._paths:
            raise LoRAError(f"the LoRA adapter name {name!r} is already in use" if name else
                            "a LoRA adapter needs a name")  # fmt: skip
        allowed = self.config.allowed_dirs if restricted else None
        adapter = read_adapter(name, path, self.cfg, self.config.max_lora_rank, self.dtype, allowed)
        self._paths[name] = adapter.path
        self._keep(adapter)
        log.info("LoRA adapter %s (rank %d) registered from %s", name, adapter.rank, path)
        return adapter

    def remove(self, name: str, busy: set[int]) -> None:
        """Unregisters an adapter; refused while requests run with it (`busy`: slots in use)."""
        self.path(name)
        slot = self.slot_of(name)
        if slot is not None and slot in busy:
            raise LoRAError(f"the LoRA adapter {name!r} is in use by running requests")
        del self._paths[name]
        self._parsed.pop(name, None)
        if slot is not None:
            self._slots[slot] = None
            self._slot_use.move_to_end(slot, last=False)  # reused first

    def slot_of(self, name: str) -> int | None:
        return self._slots.index(name) if name in self._slots else None

    def acquire(
        self, name: str, busy: set[int], write: Callable[[int, LoRAAdapter], None]
    ) -> tuple[int, bytes] | None:
        """The slot of adapter `name` and its digest, writing it into a slot first if it is not
        in one: a free slot, else the least recently used one no running request holds
        (`busy`). None: every slot is busy, so the request waits."""
        slot = self.slot_of(name)
        if slot is None:
            slot = next((s for s in self._slot_use if s not in busy), None)
            if slot is None:
                return None
            adapter = self._adapter(name)
            write(slot, adapter)
            self._slots[slot] = name
            self.num_loads += 1
        self._slot_use.move_to_end(slot)
        return slot, self._adapter(name).digest

    def _adapter(self, name: str) -> LoRAAdapter:
        adapter = self._parsed.get(name)
        if adapter is None:  # dropped from the host cache: read (and check) again
            path = self.path(name)
            adapter = read_adapter(name, path, self.cfg, self.config.max_lora_rank, self.dtype)
        self._keep(adapter)
        return adapter

    def _keep(self, adapter: LoRAAdapter) -> None:
        self._parsed[adapter.name] = adapter
        self._parsed.move_to_end(adapter.name)
        while len(self._parsed) > self.config.cpu_capacity:
            self._parsed.popitem(last=False)
