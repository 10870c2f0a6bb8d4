"""The garbage collector in a process that serves one engine.

A built engine leaves several hundred thousand objects alive in the process for good (the
model's and the compiled steps' Python side, the tokenizer, the libraries' own state). CPython's
full collections traverse every tracked object, so each one, triggered by what requests create,
stalls the engine loop for as long as that traversal takes, on whichever step it falls: in
bench/host_overhead.py it made a step's postprocessing several times slower on average. Freezing
what is alive once the engine is built (vLLM's engine core does the same) leaves the collector
only the objects created since.

An API server (serving/serve.py) freezes its own once its front is loaded: with the engine in a
core process, the server's libraries (FastAPI, pydantic, the tokenizer) still leave ~150,000
objects, and each full collection over them took 53-57 ms, a pause for every stream it serves.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Collects what is garbage now, then moves every object still alive out of the
    collector's reach for good. For a process that builds its engine once and serves it (an
    object frozen here that later becomes cyclic garbage is never freed), not for one that
    builds engine after engine (tests)."""
    gc.collect()
    gc.freeze()
