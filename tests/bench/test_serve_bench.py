"""bench/serve.py against a real `xlaserve serve` on the tiny model: the load generator's help,
a short random run and a shared-prefix run, so that the tool cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import serve
from tests.engine.tiny_model import write_tiny_checkpoint
from tests.serving.openai_server import ROOT, running_server


@pytest.fixture(scope="module")
def server(tmp_path_factory, request):
    directory = write_tiny_checkpoint(tmp_path_factory.mktemp("bench") / "tiny")
    cache_provider = getattr(request.config, "cache", None)
    cache = (
        cache_provider.mkdir("xla-compilation-cache")
        if cache_provider is not None
        else tmp_path_factory.mktemp("xla-compilation-cache")
    )
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with running_server(directory, cache, log) as running:
        yield running, directory


def test_help_lists_the_vllm_flags():
    out = subprocess.run(
        [sys.executable, "bench/serve.py", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    for flag in ("--dataset-name", "--request-rate", "--max-concurrency", "--goodput"):
        assert flag in out.stdout


def test_random_run_times_every_request(server, tmp_path, capsys):
    running, directory = server
    result = serve.main(
        ["--base-url", running.url, "--model", "tiny", "--tokenizer", str(directory),
         "--dataset-name", "random", "--num-prompts", "6", "--random-input-len", "16:40",
         "--random-output-len", "8", "--ignore-eos", "--max-concurrency", "3",
         "--num-warmups", "1", "--goodput", "ttft:60000", "--scrape-metrics",
         "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json",
         "--disable-progress"]
    )  # fmt: skip
    assert result["completed"] == 6, result["errors"]
    assert result["total_output_tokens"] == 6 * 8  # EOS ignored: exactly max_tokens each
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert 0 < result["median_ttft_ms"] <= result["median_e2el_ms"]
    assert result["median_tpot_ms"] > 0 and len(result["itls"][0]) >= 1
    assert result["server_metrics"]["xlaserve:generation_tokens_total"] >= 6 * 8
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["output_throughput"] == pytest.approx(result["output_throughput"])
    assert "Serving Benchmark Result" in capsys.readouterr().out


def test_shared_prefix_run_hits_the_prefix_cache(server):
    running, directory = server
    result = serve.main(
        ["--base-url", running.url, "--model", "tiny", "--tokenizer", str(directory),
         "--dataset-name", "shared-prefix", "--gsp-num-groups", "2",
         "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "96",
         "--gsp-question-len", "8", "--gsp-output-len", "4", "--max-concurrency", "1",
         "--scrape-metrics", "--disable-progress"]
    )  # fmt: skip
    assert result["completed"] == 6, result["errors"]
    assert result["server_metrics"]["prefix_cache_hit_rate"] > 0.3
