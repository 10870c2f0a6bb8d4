"""Whether this jax's TPU interpret mode runs jax's maintained ragged paged attention kernel.

On jax 0.10 it does not: the kernel reshapes its VMEM K/V buffer ref before its strided loads,
and the TPU interpreter (like the HLO one) models only indexed refs, so it raises
(`'ReshapeTransform' object has no attribute 'indices'`). The tests that run the float TPU path
then skip, naming the error, and run where the interpreter can (a later jax) or on a TPU; what
the wrapper adds is still checked on CPU through jax's own pure-jnp reference of the kernel
(`test_tpu_kernel.test_wrapper_inputs_through_the_maintained_reference`).
`test_tpu_kernel.test_interpreter_probe_is_not_hiding_a_wrapper_bug` keeps the probe honest.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu import ragged_paged_attention as maintained


@functools.cache
def tpu_interpret_error() -> str | None:
    """None if the maintained kernel runs in TPU interpret mode here, else the error raised."""
    q = jnp.zeros((8, 2, 128), jnp.float32)
    kv_pages = jnp.zeros((2, 16, 2, 128), jnp.float32)
    one = jnp.ones((1,), jnp.int32)
    try:
        with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
            out = maintained.ragged_paged_attention(
                q,
                kv_pages,
                one,
                jnp.zeros((1, 1), jnp.int32),
                jnp.array([0, 1], jnp.int32),
                one,
                num_kv_pages_per_block=1,
                num_queries_per_block=8,
            )
        np.asarray(out)
    except Exception as e:
        return f"{type(e).__name__}: {str(e).strip().splitlines()[-1]}"[:300]
    return None


def needs_tpu_interpreter() -> pytest.MarkDecorator:
    """Skips a test that runs the float TPU path where the interpreter cannot, saying why."""
    error = tpu_interpret_error()
    return pytest.mark.skipif(
        error is not None,
        reason=f"jax {jax.__version__}'s TPU interpret mode cannot run jax's maintained ragged "
        f"paged attention kernel ({error}); runs on a TPU or a jax whose interpreter can",
    )
