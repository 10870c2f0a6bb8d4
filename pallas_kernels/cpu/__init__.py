"""CPU kernels in C++ (`kernels.cc`), called from jitted code through `jax.ffi`.

XLA:CPU runs the reference attention's gathers and a one-row product with int8 or int4 weights
far below the machine's speed (shared/BASELINES.md, bench/RESULTS.md), and copies a bfloat16
cache pool on every scatter into it; these kernels read the cache pages and the integers where
they lie and write new keys and values in place. Each has a pure-jnp twin that is its oracle in
the tests and the path on every other platform and wherever the library cannot be built.

The library is compiled once per machine with the system's C++ compiler into
~/.cache/xlaserve/cpu-kernels/ (`make` does it at install: `python -m pallas_kernels.cpu`), keyed
by the source, the jaxlib version and the CPU, since it is built with -march=native.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.cc")
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "xlaserve" / "cpu-kernels"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")
TARGETS = {"xlaserve_ragged_attention": "XlaserveRaggedAttention",
           "xlaserve_quantized_matmul": "XlaserveQuantizedMatmul",
           "xlaserve_quantized_matmuls": "XlaserveQuantizedMatmuls",
           "xlaserve_dense_matmul": "XlaserveDenseMatmul",
           "xlaserve_write_kv": "XlaserveWriteKV"}  # fmt: skip
DENSE_MAX_ROWS = 16  # kDenseMaxRows in kernels.cc
MAX_WEIGHTS = 62  # kMaxWeights in kernels.cc: quantized_matmuls' weights, a flag bit each


def _cpu_id() -> str:
    """The CPU's model and feature flags (the build is -march=native)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return "\n".join(keep)


def library_path() -> Path:
    key = "\n".join([SOURCE.read_text(), jaxlib.__version__, " ".join(FLAGS), _cpu_id()])
    return CACHE / hashlib.sha256(key.encode()).hexdigest()[:16] / "libxlaserve_cpu.so"


def build() -> Path:
    """Compiles the library unless this machine already has it; returns its path."""
    path = library_path()
    if path.exists():
        return path
    name = os.environ.get("CXX", "g++")  # the usual variable for the C++ compiler
    compiler = shutil.which(name)
    if compiler is None:
        raise RuntimeError(f"no C++ compiler {name!r} on PATH (set CXX to choose one)")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        command = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(out)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed:\n{done.stderr[-2000:]}")
        out.replace(path)  # atomic: a concurrent build of the same key writes the same file
    return path


@functools.cache
def available() -> bool:
    """Builds (if needed), loads and registers the kernels once; False if that fails."""
    try:
        library = ctypes.cdll.LoadLibrary(str(build()))
    except (OSError, RuntimeError) as e:
        log.warning("CPU kernels unavailable, using the XLA paths: %s", e)
        return False
    for name, symbol in TARGETS.items():
        capsule = jax.ffi.pycapsule(getattr(library, symbol))
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    return True


def ragged_attention(
    q: jax.Array,  # f[T, Hq, D]
    kv_pages: jax.Array,  # f32 | bf16[num_pages, page_size, 2*Hkv, D]
    kv_lens: jax.Array,  # i32[S]
    page_table: jax.Array,  # i32[S, P]
    cu_q_lens: jax.Array,  # i32[S+1]
    num_seqs: jax.Array,  # i32[]
    *,
    sm_scale: float,
    sliding_window: int | None,
    logit_soft_cap: float | None,
) -> jax.Array:
    """Ragged paged attention over the paged cache in the contract of
    `pallas_kernels.ragged_paged_attention` (decode, prefill and chunked-prefill rows alike, each
    row over the keys up to its position), summed in float32; [T, Hq, D] in q's dtype with the
    padding rows zero. Needs `available()`; head_dim 64, 128 or 256 and Hq / Hkv <= 8."""
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    call = jax.ffi.ffi_call("xlaserve_ragged_attention", out, vmap_method="sequential")
    return call(
        q.astype(jnp.float32),
        kv_pages,
        kv_lens.astype(jnp.int32),
        page_table.astype(jnp.int32),
        cu_q_lens.astype(jnp.int32),
        num_seqs.astype(jnp.int32).reshape(()),
        sm_scale=np.float32(sm_scale),
        sliding_window=np.int64(sliding_window or 0),  # 0: no window (an FFI attribute)
        logit_soft_cap=np.float32(logit_soft_cap or 0.0),  # 0: no cap
    ).astype(q.dtype)


def write_kv(
    kv_pages: jax.Array,  # dtype[num_pages, page_size, 2*Hkv, Dp]
    rows: jax.Array,  # dtype[T, 2*Hkv, Dp]
    slots: jax.Array,  # i32[T]; outside [0, num_pages * page_size): not written
) -> jax.Array:
    """kv_pages with row t written at slot slots[t], updated in place (the result aliases
    kv_pages, so under jit with the cache donated nothing else is copied). Needs `available()`."""
    out = jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype)
    call = jax.ffi.ffi_call(
        "xlaserve_write_kv", out, vmap_method="sequential", input_output_aliases={0: 0}
    )
    return call(kv_pages, rows.astype(kv_pages.dtype), slots.astype(jnp.int32))


def quantized_matmul(
    x: jax.Array,  # f32[T, K]
    values: jax.Array,  # i8[K, N] | u8[K/2, N]; transposed: i8[N, K] | u8[N, K/2]
    scales: jax.Array,  # f32[K/G, N]; transposed: f32[N, K/G]; f16 with int8_activations too
    offsets: jax.Array | None,  # like scales, or None
    *,
    bits: int,
    transposed: bool,
    int8_activations: bool = False,
    layer: int | None = None,
) -> jax.Array:
    """x @ w (or x @ w.T when transposed) for w = values * scales + offsets in groups of G
    consecutive elements along K, 4-bit values two per byte along K (element 2j in the low
    nibble of byte j); f32[T, N]. Reads the weights once per 2 rows of x (the [K, N] layout) or
    once for all of them (transposed: 4 table rows at a time dequantized into L1). Shapes the
    kernel takes: `engine.models.quant._kernel_takes`.

    With `int8_activations` (int4 [K, N] weights, G a multiple of 32, N of 64; or an int8 [N, K]
    table without offsets, G a multiple of 32, K of 64 up to 4096): x̂ @ (values * scales) +
    x @ offsets, where x̂ is each row of x rounded to int8 in blocks of 32 as llama.cpp's Q8_0
    does (scale max |x| / 127, round half to even), the integer products summed exactly
    (AVX-512 VNNI's byte dot products where the CPU has them); a row's result does not depend
    on the other rows. Its scales and offsets may be float16 (llama.cpp's Q4_1 and Q8_0 keep
    them so), read as float32.

    With `layer`, values, scales and offsets are stacks of every layer's weight [L, ...] and
    the product is with the layer-th, read in place (one array for XLA to pass, not L)."""
    n = values.shape[-2] if transposed else values.shape[-1]
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    call = jax.ffi.ffi_call("xlaserve_quantized_matmul", out, vmap_method="sequential")
    dummy = jnp.zeros((1, 1), jnp.float32)
    return call(
        x.astype(jnp.float32),
        values,
        scales,
        dummy if offsets is None else offsets,
        bits=np.int64(bits),
        transposed=np.int64(transposed),
        has_offsets=np.int64(offsets is not None),
        int8_activations=np.int64(int8_activations),
        layer=np.int64(-1 if layer is None else layer),
    )


def quantized_matmuls(
    x: jax.Array,  # f32[T, K]
    weights: Sequence[tuple[jax.Array, jax.Array, jax.Array | None]],  # values, scales, offsets
    *,
    int8_activations: Sequence[bool] | None = None,
    layer: int | None = None,
) -> list[jax.Array]:
    """[x @ w for w in weights] for int4 [K, N_i] weights in the same groups along K (a multiple
    of 32), N_i multiples of 64, offsets for all or none: `quantized_matmul(..., bits=4,
    transposed=False, int8_activations=a)` of each, bit for bit, in one call, so that one
    parallel loop covers every weight's columns and x is rounded once for the weights with
    8-bit activations (q, k and v; gate and up). `int8_activations`: one flag per weight (None:
    every weight); the weights with 8-bit activations have scales and offsets of one float
    dtype, the others float32 ones. `layer`: as `quantized_matmul`'s, for every weight."""
    has_offsets = weights[0][2] is not None
    if any((offsets is not None) != has_offsets for _, _, offsets in weights):
        raise ValueError("quantized_matmuls: offsets for every weight or for none")
    flags = [True] * len(weights) if int8_activations is None else list(int8_activations)
    if len(flags) != len(weights):
        raise ValueError("quantized_matmuls: one int8_activations flag per weight")
    if len(weights) > MAX_WEIGHTS:
        raise ValueError(f"quantized_matmuls: at most {MAX_WEIGHTS} weights in one call")
    out = [jax.ShapeDtypeStruct((x.shape[0], v.shape[-1]), jnp.float32) for v, _, _ in weights]
    call = jax.ffi.ffi_call("xlaserve_quantized_matmuls", out, vmap_method="sequential")
    dummy = jnp.zeros((1, 1), jnp.float32)
    args = [a if a is not None else dummy for w in weights for a in w]
    return list(
        call(
            x.astype(jnp.float32),
            *args,
            has_offsets=np.int64(has_offsets),
            int8_activations=np.int64(sum(1 << i for i, flag in enumerate(flags) if flag)),
            layer=np.int64(-1 if layer is None else layer),
        )
    )


def dense_matmul(
    x: jax.Array,  # f32[T, K], T <= DENSE_MAX_ROWS
    w: jax.Array,  # f32[K, N] (N a multiple of 16); transposed: f32[N, K] (K a multiple of 16)
    *,
    transposed: bool,
) -> jax.Array:
    """x @ w (or x @ w.T when transposed) in float32 for a few rows, f32[T, N], reading the
    weight in place once per 4 rows ([K, N]) or once for all rows ([N, K]). Each output element
    is summed in one fixed order whatever T, so a row's result does not depend on the others."""
    n = w.shape[0] if transposed else w.shape[1]
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    call = jax.ffi.ffi_call("xlaserve_dense_matmul", out, vmap_method="sequential")
    return call(x, w, transposed=np.int64(transposed))


__all__ = [
    "available",
    "build",
    "dense_matmul",
    "quantized_matmul",
    "quantized_matmuls",
    "ragged_attention",
    "write_kv",
]
