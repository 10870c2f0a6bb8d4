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

Young collections are the other cost. CPython starts one each time 700 more tracked objects
(containers) are alive than at the last, and it traverses every one of them. A step makes
several such objects per sequence (its scheduled row, its delta, their lists) that live until
the step ends: at 1,024 sequences, six collections fell inside every step, each finding that
step's objects alive and moving them to an older generation, whose collections then traverse
them again (1.7-2.6 ms of a 20-31 ms step in bench/host_overhead.py's loop). With a threshold
above a step's worth of objects, a collection comes seldom and finds few of them alive: they
were freed, as nearly all objects are, by reference counting the moment the step let go of
them. Only cyclic garbage waits longer for the collector, at most `YOUNG_COLLECTION_THRESHOLD`
objects of it.
"""

from __future__ import annotations

import gc

YOUNG_COLLECTION_THRESHOLD = 50_000  # CPython's default: 700


def configure_collector() -> None:
    """For a process that builds its engine (or its API server's front) once and then serves:
    freezes what is alive (`freeze_startup_objects`) and lets young collections wait for
    `YOUNG_COLLECTION_THRESHOLD` new objects, more than a step or a burst of requests makes."""
    freeze_startup_objects()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, *gc.get_threshold()[1:])


def freeze_startup_objects() -> None:
    """Collects what is garbage now, then moves every object still alive out of the
    collector's reach for good. For a process that builds its engine once and serves it (an
    object frozen here that later becomes cyclic garbage is never freed), not for one that
    builds engine after engine (tests)."""
    gc.collect()
    gc.freeze()
