"""Counts the XLA compilations this process performs, whoever triggers them.

The engine compiles one step per bucket at start-up and nothing after; this counter is how
tests and the metrics endpoint check that claim.
"""

from __future__ import annotations

import threading

import jax

# JAX times every executable it obtains with the first event, persistent-cache hits included,
# and records each hit with the second: compilations are the difference.
_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_lock = threading.Lock()
_count = 0
_hits = 0
_installed = False


def _on_event(event: str, duration_secs: float, **kwargs: object) -> None:
    global _count
    if event == _BACKEND_COMPILE_EVENT:
        with _lock:
            _count += 1


def _on_hit(event: str, **kwargs: object) -> None:
    global _hits
    if event == _CACHE_HIT_EVENT:
        with _lock:
            _hits += 1


def install() -> None:
    """Starts counting (idempotent)."""
    global _installed
    with _lock:
        if not _installed:
            jax.monitoring.register_event_duration_secs_listener(_on_event)
            jax.monitoring.register_event_listener(_on_hit)
            _installed = True


def count() -> int:
    """Backend compilations since `install()`; persistent-cache hits are not compilations."""
    with _lock:
        return _count - _hits


def enable_persistent_cache(directory: str | None) -> None:
    """XLA's persistent compilation cache in `directory` (None or '': off): a second start with
    the same model and configuration loads every compiled program (each step bucket, and the
    small ones around it) instead of compiling it."""
    if directory:
        jax.config.update("jax_compilation_cache_dir", directory)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
