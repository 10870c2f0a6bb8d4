"""Multi-process engines (multi-controller JAX): one engine spans the devices of several
processes. Process 0, the leader, runs the scheduler and the servers; before each step it
broadcasts the step's input (`broadcast_one_to_all`, a collective over every process's
devices), and every process then runs the same compiled step on its shard.

Liveness goes through the distributed runtime's key-value store: each follower bumps a
heartbeat key twice a second, and the leader's monitor calls `on_dead` when one stops, so that
the leader fails its health check and exits instead of waiting forever in a collective.

Boundary code.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Sharding

from engine.errors import XlaserveError

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 0.5
DEAD_AFTER_SECONDS = 3.0
SHUTDOWN_TIMEOUT_SECONDS = 5  # the distributed runtime's exit barrier (a dead peer never joins)


def initialize(
    coordinator_address: str | None, num_processes: int | None, process_id: int | None
) -> bool:
    """Starts jax.distributed when asked to (or on a multi-host Cloud TPU, where JAX finds the
    addresses itself); False when this is a single-process run."""
    given = (coordinator_address, num_processes, process_id)
    if all(x is None for x in given) and not _on_multihost_tpu():
        return False
    if any(x is None for x in given) and not all(x is None for x in given):
        raise XlaserveError("--coordinator-address, --num-processes and --process-id go together")
    # Cross-process collectives on CPU need an implementation; TPU and GPU ignore this.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address,
        num_processes,
        process_id,
        shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_SECONDS,
    )
    log.info("process %d of %d", jax.process_index(), jax.process_count())
    return True


def _on_multihost_tpu() -> bool:
    return "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")


def is_leader() -> bool:
    return jax.process_index() == 0


def put_replicated(tree: Any, sharding: Sharding) -> Any:
    """Host arrays -> arrays replicated over `sharding`'s devices; with several processes each
    process places only its own devices' copies (every process holds the same values)."""
    if sharding.is_fully_addressable:
        return jax.device_put(tree, sharding)
    return jax.tree.map(
        lambda x: jax.make_array_from_callback(np.shape(x), sharding, lambda i: np.asarray(x)[i]),
        tree,
    )


# ---- the step input, leader to followers ------------------------------------------------------
# Step n's header (the bucket and the step variant, a few numbers) is the key-value store's
# `xlaserve/step/{n}`: a follower may wait for it as long as the leader is idle. The batch itself
# then goes by `broadcast_one_to_all`, a collective every process joins at once.

READY_TIMEOUT_MS = 30 * 60 * 1000  # followers compile their steps meanwhile
POLL_TIMEOUT_MS = 60 * 1000
_STOP = "stop"


class Leader:
    """Process 0's side: sends each step to the followers."""

    def __init__(self) -> None:
        self._client = _client()
        self._step = 0

    def wait_for_followers(self) -> None:
        """Returns when every follower has built and compiled its engine."""
        for p in range(1, jax.process_count()):
            self._client.blocking_key_value_get(f"xlaserve/ready/{p}", READY_TIMEOUT_MS)

    def send(self, batch: Any, options: Any) -> None:
        """Before running a step: its header, then its batch, to every follower."""
        t, s = batch.token_ids.shape[0], batch.kv_lens.shape[0]
        flags = (options.apply_penalties, options.num_top_logprobs > 0,
                 options.num_prompt_logprobs is not None,
                 batch.token_bitmask is not None)  # fmt: skip
        self._publish(",".join(str(int(x)) for x in (t, s, *flags)))
        multihost_utils.broadcast_one_to_all(batch, is_source=True)

    def stop(self) -> None:
        """Followers leave `follow`."""
        self._publish(_STOP)

    def _publish(self, header: str) -> None:
        self._step += 1
        self._client.key_value_set(f"xlaserve/step/{self._step}", header)
        if self._step > 1:  # every follower read it before joining the last broadcast
            self._client.key_value_delete(f"xlaserve/step/{self._step - 1}")


def follow(runner: Any) -> None:
    """Follower: runs every step the leader sends on this process's shard, until told to stop.
    `runner` is the (compiled) `ModelRunner` of an engine built exactly as the leader's."""
    from engine.scheduler import SchedulerOutput

    client = _client()
    client.key_value_set(f"xlaserve/ready/{jax.process_index()}", "1")
    step = 0
    while True:
        step += 1
        header = _wait_for(client, f"xlaserve/step/{step}")
        if header == _STOP:
            return
        t, s, penalties, logprobs, prompt_logprobs, constrained = (
            int(x) for x in header.split(",")
        )
        template = runner.builder.build_padded(
            SchedulerOutput(), None, t, s, penalties=bool(penalties), constrained=bool(constrained)
        )
        batch = multihost_utils.broadcast_one_to_all(template, is_source=False)
        options = runner.options(
            penalties=bool(penalties),
            logprobs=bool(logprobs),
            prompt_logprobs=bool(prompt_logprobs),
        )
        runner.run_batch(batch, options)


def _wait_for(client: Any, key: str) -> str:
    while True:  # an idle leader sends nothing for as long as it likes
        try:
            return str(client.blocking_key_value_get(key, POLL_TIMEOUT_MS))
        except Exception as e:  # the runtime's DEADLINE_EXCEEDED; anything else is fatal
            if "DEADLINE_EXCEEDED" not in str(e):
                raise


def exit_now(status: int) -> None:
    """Ends the process at once. After a peer died, the distributed runtime's exit barrier
    (which JAX runs at exit) can never complete, and its failure aborts the process."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


# ---- liveness ---------------------------------------------------------------------------------


def _client() -> Any:
    # The distributed runtime's client (its key-value store); JAX has no public accessor.
    from jax._src import distributed

    return distributed.global_state.client


def start_heartbeat() -> threading.Thread:
    """Follower: bumps this process's heartbeat key until the process ends."""
    client, key = _client(), f"xlaserve/heartbeat/{jax.process_index()}"

    def beat() -> None:
        count = 0
        while True:
            count += 1
            client.key_value_set(key, str(count), allow_overwrite=True)
            time.sleep(HEARTBEAT_SECONDS)

    thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
    thread.start()
    return thread


def _try_get(client: Any, key: str) -> str | None:
    try:
        return str(client.key_value_try_get(key))
    except Exception:  # not set yet (the runtime's NOT_FOUND error)
        return None


def monitor_followers(on_dead: Callable[[int], None]) -> threading.Thread:
    """Leader: calls `on_dead(process_id)` once, when a follower's heartbeat stops (or never
    starts) for DEAD_AFTER_SECONDS."""
    client = _client()
    followers = range(1, jax.process_count())

    def watch() -> None:
        seen: dict[int, tuple[str | None, float]] = {p: (None, time.monotonic()) for p in followers}
        while True:
            time.sleep(HEARTBEAT_SECONDS)
            now = time.monotonic()
            for p in followers:
                value = _try_get(client, f"xlaserve/heartbeat/{p}")
                if value != seen[p][0]:
                    seen[p] = (value, now)
                elif now - seen[p][1] > DEAD_AFTER_SECONDS:
                    on_dead(p)
                    return

    thread = threading.Thread(target=watch, name="follower-monitor", daemon=True)
    thread.start()
    return thread
