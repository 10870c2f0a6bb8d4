"""Converted checkpoints: parameters as xlaserve holds them, saved with orbax-checkpoint.

`xlaserve convert` writes a directory that loads without any conversion:

    DIR/xlaserve.json   format version, the ModelConfig, the quantization, and each
                        QuantizedWeight's static fields (bits, axis, dtype) by parameter path
    DIR/params/         the parameter pytree (orbax; a QuantizedWeight saved as its arrays)
    DIR/tokenizer.*     tokenizer files (copied from a HF directory, or rebuilt from GGUF
                        metadata), tokenizer_config.json with the chat template

Restoring passes orbax a target per leaf with the sharding the plan gives it, so each process
reads from storage only the slices its devices hold; the restored arrays are the saved ones bit
for bit (a different --dtype casts float leaves as they are read).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, SingleDeviceSharding

from engine.config import ModelConfig, QuantizationConfig, RopeScaling
from engine.errors import ModelLoadError, XlaserveError
from engine.models.layers import Params
from engine.models.quant import QuantizedWeight
from sharding.rules import ShardingPlan, param_axes

FORMAT = 1
METADATA = "xlaserve.json"
PARAMS = "params"
# What a Hugging Face directory's tokenizer is made of (all optional but the model file).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
_QUANTIZED_PARTS = ("values", "scales", "offsets")


def is_converted(path: Path) -> bool:
    return path.is_dir() and (path / METADATA).is_file()


def save(
    directory: Path,
    cfg: ModelConfig,
    params: Params,
    *,
    tokenizer_source: Path,
    quantization: QuantizationConfig | None = None,
) -> None:
    """Writes `params` (and the tokenizer found at `tokenizer_source`, a HF directory or a
    .gguf file) into `directory`, which must not exist or be empty or a converted checkpoint
    (replaced)."""
    check_output(directory)
    if directory.is_dir():
        shutil.rmtree(directory)  # an earlier conversion (or an empty directory)
    directory.mkdir(parents=True)
    quantized: dict[str, dict[str, Any]] = {}
    plain = _to_plain(params, quantized)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save((directory / PARAMS).absolute(), plain)
    _write_tokenizer(directory, tokenizer_source)
    metadata = {
        "format": FORMAT,
        "config": dataclasses.asdict(cfg),
        "quantization": None if quantization is None else dataclasses.asdict(quantization),
        "quantized": quantized,
    }
    (directory / METADATA).write_text(json.dumps(metadata, indent=1))


def check_output(directory: Path) -> None:
    """Refuses a directory that holds anything but an earlier conversion."""
    if directory.exists() and not directory.is_dir():
        raise XlaserveError(f"--output {directory}: exists and is not a directory")
    if directory.is_dir() and any(directory.iterdir()) and not is_converted(directory):
        raise XlaserveError(
            f"--output {directory}: a non-empty directory that is not a converted checkpoint"
        )


def _to_plain(params: Params, quantized: dict[str, dict[str, Any]]) -> Any:
    """The pytree with each QuantizedWeight as a dict of its arrays; its static fields go into
    `quantized`, keyed by its path."""

    def plain(path: tuple[Any, ...], leaf: Any) -> Any:
        if not isinstance(leaf, QuantizedWeight):
            return leaf
        quantized[_key(path)] = {"bits": leaf.bits, "axis": leaf.axis, "dtype": leaf.dtype}
        parts = {name: getattr(leaf, name) for name in _QUANTIZED_PARTS}
        return {name: value for name, value in parts.items() if value is not None}

    return jax.tree_util.tree_map_with_path(
        plain, params, is_leaf=lambda x: isinstance(x, QuantizedWeight)
    )


def _key(path: tuple[Any, ...]) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _write_tokenizer(directory: Path, source: Path) -> None:
    if source.is_dir():
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, directory / name)
        return
    from engine.tokenizer import load_tokenizer

    load_tokenizer(source).save(directory)


@dataclasses.dataclass(frozen=True)
class ConvertedSource:
    """An opened converted checkpoint: its metadata read, the parameters not yet."""

    path: Path
    stored: ModelConfig  # as converted
    quantization: QuantizationConfig | None
    quantized: dict[str, dict[str, Any]]

    def restore(
        self,
        cfg: ModelConfig,
        plan: ShardingPlan | None,
        quantization: QuantizationConfig | None,
    ) -> Params:
        """The parameters, each leaf placed as `plan` shards it (each process reading only its
        slices), or on the default device; float leaves in `cfg.dtype`."""
        weights = lambda q: q and (q.method, q.group_size)  # int8 activations are not held
        if quantization is not None and weights(quantization) != weights(self.quantization):
            held = self.quantization.method if self.quantization else "no quantization"
            raise XlaserveError(
                f"{self.path} was converted with {held}; --quantization {quantization.method} "
                "needs a conversion from the original model"
            )
        if plan is not None and self.quantized:
            raise XlaserveError(
                f"{self.path}: quantized weights are not supported with tensor or pipeline "
                "parallelism yet"
            )
        with ocp.StandardCheckpointer() as checkpointer:
            stored = checkpointer.metadata(self.path.absolute() / PARAMS).item_metadata.tree
            if plan is not None and plan.num_stages > 1:
                return _restore_stacked(checkpointer, self.path, stored, cfg, plan)
            target = _targets(stored, cfg.dtype, plan)
            plain = checkpointer.restore(self.path.absolute() / PARAMS, target)
        return _from_plain(plain, self.quantized, cfg.dtype)


def open_converted(path: Path, dtype: str | None) -> tuple[ModelConfig, ConvertedSource]:
    """The config (in `dtype`, default the converted one) and source of a converted checkpoint."""
    try:
        metadata = json.loads((path / METADATA).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path / METADATA}: not readable JSON ({e})") from e
    if metadata.get("format") != FORMAT:
        raise ModelLoadError(
            f"{path}: converted checkpoint format {metadata.get('format')!r}, expected {FORMAT}; "
            "convert the model again"
        )
    if not (path / PARAMS).is_dir():
        raise ModelLoadError(f"{path}: no {PARAMS}/ directory (an unfinished conversion?)")
    stored = _config(metadata["config"])
    method = metadata.get("quantization")
    quantization = None if method is None else QuantizationConfig(**method)
    source = ConvertedSource(path, stored, quantization, metadata.get("quantized", {}))
    return stored.replace(dtype=dtype or stored.dtype), source


def _config(fields: dict[str, Any]) -> ModelConfig:
    rope = fields.get("rope_scaling")
    sliding = fields.get("sliding_layers")
    return ModelConfig(
        **{
            **fields,
            "rope_scaling": None if rope is None else RopeScaling(**rope),
            "sliding_layers": None if sliding is None else tuple(sliding),
        }
    )


def _targets(stored: Any, dtype: str, plan: ShardingPlan | None) -> Any:
    """A ShapeDtypeStruct per stored array: float leaves in `dtype` (integers and quantization
    scales as stored), with the plan's sharding or on the default device."""
    device = SingleDeviceSharding(jax.local_devices()[0])

    def target(path: tuple[Any, ...], meta: Any) -> jax.ShapeDtypeStruct:
        shape = tuple(meta.shape)
        sharding = device if plan is None else plan.sharding(param_axes(path, len(shape)), shape)
        return jax.ShapeDtypeStruct(shape, _dtype(path, meta.dtype, dtype), sharding=sharding)

    return jax.tree_util.tree_map_with_path(target, stored)


def _dtype(path: tuple[Any, ...], stored: Any, dtype: str) -> Any:
    name = str(getattr(path[-1], "key", ""))
    if name in _QUANTIZED_PARTS or not jnp.issubdtype(stored, jnp.floating):
        return stored
    return jnp.dtype(dtype)


def _from_plain(plain: Any, quantized: dict[str, dict[str, Any]], dtype: str) -> Params:
    """The restored pytree with each quantized entry made a QuantizedWeight again."""

    def rebuild(path: tuple[Any, ...], node: Any) -> Any:
        static = quantized.get(_key(path))
        if static is None:
            return node
        return QuantizedWeight(
            node["values"], node["scales"], node.get("offsets"), **{**static, "dtype": dtype}
        )

    return jax.tree_util.tree_map_with_path(
        rebuild, plain, is_leaf=lambda x: isinstance(x, dict) and "values" in x
    )


def _restore_stacked(
    checkpointer: ocp.StandardCheckpointer,
    path: Path,
    stored: Any,
    cfg: ModelConfig,
    plan: ShardingPlan,
) -> Params:
    """Pipeline stages: each layer restored onto its stage's devices (sharded as the plan
    shards one layer), then the layers of each stage stacked on device into [L, ...] leaves."""
    per_stage = cfg.num_layers // plan.num_stages
    stages = [plan.stage(s) for s in range(plan.num_stages)]
    # Leaves outside the layers are held by every stage.
    target = _targets({k: v for k, v in stored.items() if k != "layers"}, cfg.dtype, plan)
    target["layers"] = [
        _targets(layer, cfg.dtype, stages[i // per_stage])
        for i, layer in enumerate(stored["layers"])
    ]
    restored = checkpointer.restore(path.absolute() / PARAMS, target)
    layers = restored.pop("layers")
    stacked = {name: _stack([layer[name] for layer in layers], plan, name) for name in layers[0]}
    return {**restored, "layers": stacked}


def _stack(layers: list[jax.Array], plan: ShardingPlan, name: str) -> jax.Array:
    """[L, ...] from L per-layer arrays, each already on the devices that hold its layer."""
    shape = (len(layers), *layers[0].shape)
    path = (jax.tree_util.DictKey("layers"), jax.tree_util.DictKey(name))
    sharding: NamedSharding = plan.sharding(param_axes(path, len(shape)), shape)
    shards_of = [{s.device: s.data for s in layer.addressable_shards} for layer in layers]
    arrays = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        assert index is not None  # a NamedSharding indexes every device
        held = range(len(layers))[index[0]]
        arrays.append(jnp.stack([shards_of[i][device] for i in held]))
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)
