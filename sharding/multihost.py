"""Multi-process engines (multi-controller JAX).

Boundary code. See `serving` for how a leader and its followers are started.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding


def put_replicated(tree: Any, sharding: Sharding) -> Any:
    """Host arrays -> arrays replicated over `sharding`'s devices; with several processes each
    process places only its own devices' copies (every process holds the same values)."""
    if sharding.is_fully_addressable:
        return jax.device_put(tree, sharding)
    return jax.tree.map(
        lambda x: jax.make_array_from_callback(np.shape(x), sharding, lambda i: np.asarray(x)[i]),
        tree,
    )
