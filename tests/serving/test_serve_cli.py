"""`xlaserve serve` flags: sizes with units, and argument errors before anything loads."""

from __future__ import annotations

import argparse

import pytest

from engine.config import ParallelConfig, SchedulerConfig
from serving.cli import _parser, parse_bytes


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("2GiB", 2 * 2**30),
        ("500MB", 500 * 10**6),
        ("1e9", 10**9),
        ("4096", 4096),
        ("1.5 KiB", 1536),
    ],
)
def test_parse_bytes(text: str, size: int) -> None:
    assert parse_bytes(text) == size


@pytest.mark.parametrize("text", ["2XB", "", "-1GiB", "0", "GiB"])
def test_parse_bytes_refuses(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes(text)


def test_serve_flags() -> None:
    args = _parser().parse_args(
        ["serve", "--model", "m", "--port", "9000", "--grpc-port", "9001", "--api-key", "k",
         "--served-model-name", "x", "--max-model-len", "128", "--max-num-seqs", "4",
         "--max-num-batched-tokens", "64", "--dtype", "bfloat16", "--kv-cache-memory", "1GiB",
         "--max-queued-requests", "10"]
    )  # fmt: skip
    assert (args.port, args.grpc_port, args.api_key, args.served_model_name) == (
        9000,
        9001,
        "k",
        "x",
    )
    assert (args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens) == (128, 4, 64)
    assert (args.dtype, args.kv_cache_memory, args.max_queued_requests) == ("bfloat16", 2**30, 10)


def test_step_timeout_flag() -> None:
    assert _parser().parse_args(["serve"]).step_timeout is None  # automatic
    assert _parser().parse_args(["serve", "--step-timeout", "2.5"]).step_timeout == 2.5
    for bad in ("0", "-1", "nan"):
        with pytest.raises(SystemExit):
            _parser().parse_args(["serve", "--step-timeout", bad])


def test_expert_token_counts_flag() -> None:
    from serving.cli import serve_config

    assert not serve_config(_parser().parse_args(["serve"])).observability.expert_token_counts
    args = _parser().parse_args(["serve", "--expert-token-counts"])
    assert serve_config(args).observability.expert_token_counts


def test_expert_dispatch_flag() -> None:
    from serving.cli import serve_config

    assert serve_config(_parser().parse_args(["serve"])).parallel.expert_dispatch == "allgather"
    args = _parser().parse_args(["serve", "--expert-dispatch", "all_to_all"])
    assert serve_config(args).parallel.expert_dispatch == "all_to_all"
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--expert-dispatch", "ragged"])
    with pytest.raises(ValueError, match="expert dispatch must be one of allgather, all_to_all"):
        ParallelConfig(expert_dispatch="ragged")


def test_stream_interval_flag() -> None:
    from serving.cli import serve_config

    assert serve_config(_parser().parse_args(["serve"])).scheduler.stream_interval == 1
    args = _parser().parse_args(["serve", "--stream-interval", "8"])
    assert serve_config(args).scheduler.stream_interval == 8
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--stream-interval", "0"])
    with pytest.raises(ValueError, match="stream_interval must be >= 1, got 0"):
        SchedulerConfig(stream_interval=0)
