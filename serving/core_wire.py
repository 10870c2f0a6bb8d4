"""The messages between API server processes and the engine core process (serving/engine_core.py,
serving/core_client.py), and how they cross: each message is one pickle (protocol 5) sent with
`Connection.send_bytes` over a `multiprocessing.Pipe` (a Unix socket pair), one pipe per API
server process; each write holds a list of messages (what one side had pending).

Why pickle over a pipe, not msgspec over ZeroMQ: every payload is already a Python object the
standard library pickles (SamplingParams, RequestOutput, Health, exceptions), a pipe needs no
ports and tells each side at once when the other process is gone (EOF), and neither side needs a
new dependency. The cost that matters is the per-step output message; it is kept small by
sending a step's outputs for one API server as one message, and by writing the common delta (a
running choice's new text and tokens, nothing else) as a plain tuple, which pickles several
times faster than the RequestOutput dataclass (bench/core_wire.py measures both per output).

Client -> core (each a tuple whose first item is the kind):
    (ADD, request_id, prompt, params, priority, lora_name)
    (ABORT, request_id)
    (CALL, call_id, method, args)   # add_lora, remove_lora, compile_grammar: answered by REPLY
    (STOP, timeout_s)               # from the owner only: drain, then end the engine
Core -> client:
    (HELLO, model_info, tokenizer)  # once the engine is built (or (FAILED, error) instead)
    (OUTPUTS, [compact outputs])    # one step's deltas for this API server's requests
    (REFUSED, request_id, error)    # add_request raised: the request never ran
    (REPLY, call_id, error, value)
    (STATUS, CoreStatus)            # stats and health, between steps, several times a second
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from engine.protocol import EngineStats, Health
from engine.request import CompletionOutput, RequestOutput
from serving.collector import merge_outputs

ADD, ABORT, CALL, STOP = "add", "abort", "call", "stop"
HELLO, FAILED, OUTPUTS, REFUSED, REPLY, STATUS = "hello", "failed", "out", "refused", "reply", "st"

# A running choice's delta: (request_id, ((index, text, token_ids), ...)).
CompactOutput = tuple[str, tuple[tuple[int, str, list[int]], ...]]


@dataclass(frozen=True)
class CoreStatus:
    """What the core tells every API server between steps: the engine's gauges, health and
    adapters, and how its loop is doing (for the server's step timeout)."""

    stats: EngineStats
    health: Health
    loras: tuple[str, ...]
    slowest_step_s: float  # the slowest step (or idle bucket compilation) so far
    last_step_age_s: float  # since the loop last finished a step, when this was sent
    compilations: int  # XLA compilations in the core process (engine.compilation.count)


def send(conn: Connection, messages: list[tuple[Any, ...]]) -> None:
    """Writes `messages` as one pickle (what one side had pending, in order)."""
    conn.send_bytes(pickle.dumps(messages, protocol=5))


def receive(conn: Connection) -> list[tuple[Any, ...]]:
    """The next write's messages; EOFError once the other side's process has gone."""
    messages: list[tuple[Any, ...]] = pickle.loads(conn.recv_bytes())
    return messages


def compact(output: RequestOutput) -> RequestOutput | CompactOutput:
    """`output` as a tuple when it is a plain running delta (what almost every step sends),
    else as it is."""
    if (
        output.finished
        or output.prompt_token_ids is not None
        or output.prompt_logprobs is not None
        or output.usage is not None
    ):
        return output
    choices = []
    for c in output.outputs:
        if c.logprobs is not None or c.finish_reason is not None or c.stop_reason is not None:
            return output
        choices.append((c.index, c.text, c.token_ids))
    return output.request_id, tuple(choices)


def expand(item: RequestOutput | CompactOutput) -> RequestOutput:
    if isinstance(item, RequestOutput):
        return item
    request_id, choices = item
    return RequestOutput(request_id, [CompletionOutput(*c) for c in choices], finished=False)


def request_id(item: RequestOutput | CompactOutput) -> str:
    return item.request_id if isinstance(item, RequestOutput) else item[0]


def finished(item: RequestOutput | CompactOutput) -> bool:
    return isinstance(item, RequestOutput) and item.finished


def merge(items: Sequence[RequestOutput | CompactOutput]) -> RequestOutput:
    """Consecutive deltas of one request, as they crossed, as one output
    (`serving.collector.merge_outputs`): a run of compact deltas (what a stream that fell
    behind has waiting) joins without making an output of each."""
    if len(items) == 1:  # a consumer that keeps up
        return expand(items[0])
    compact = [item for item in items if isinstance(item, tuple)]
    if len(compact) < len(items):
        return merge_outputs([expand(item) for item in items])
    texts: dict[int, list[str]] = {}
    tokens: dict[int, list[int]] = {}
    for _, choices in compact:
        for index, text, token_ids in choices:
            texts.setdefault(index, []).append(text)
            tokens.setdefault(index, []).extend(token_ids)
    outputs = [CompletionOutput(i, "".join(t), tokens[i]) for i, t in texts.items()]
    return RequestOutput(request_id(items[0]), outputs, finished=False)
