"""Whether this jax lowers Pallas Triton kernels for CUDA on a machine without a GPU.

jax 0.10 lowers them anywhere (it assumes compute capability 9.0 when no GPU is attached), so the
CUDA export tests run on CPU. Later releases may query the attached GPU while lowering and raise
without one; there the tests that lower for CUDA skip, naming the error, and run on the GPU
machine instead. `test_gpu_kernel.test_cuda_lowering_is_tested_where_it_can_be` fails if they
would skip on jax 0.10 or on a GPU, so they never stop running silently.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax import export
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.ragged_paged_attention import gpu


def _add_one(x_ref: jax.Ref, o_ref: jax.Ref) -> None:
    o_ref[...] = x_ref[...] + 1


@functools.cache
def cuda_lowering_error() -> str | None:
    """None if a one-line Pallas Triton kernel exports for CUDA here, else the error raised."""
    x = jax.ShapeDtypeStruct((16,), jnp.float32)
    call = pl.pallas_call(
        _add_one,
        out_shape=x,
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
    )
    try:
        export.export(
            jax.jit(call), platforms=["cuda"], disabled_checks=list(gpu.EXPORT_DISABLED_CHECKS)
        )(x)
    except Exception as e:
        return f"{type(e).__name__}: {str(e).strip().splitlines()[-1]}"[:300]
    return None


def needs_cuda_lowering() -> pytest.MarkDecorator:
    """Skips a test that lowers a Triton kernel for CUDA where this jax cannot, saying why."""
    error = cuda_lowering_error()
    return pytest.mark.skipif(
        error is not None,
        reason=f"jax {jax.__version__} cannot lower Pallas Triton for CUDA without a GPU "
        f"({error}); runs on the GPU machine",
    )
