#!/usr/bin/env bash
# The device benchmark in one go, for the GPU machine (no network; installs nothing):
#   bash bench/gpu/run.sh            Llama-3-8B shape, random bf16 weights (under 8 minutes)
#   SMALL=1 bash bench/gpu/run.sh    a shrunk model, e.g. on a CPU to test the script
#   MOE=1 bash bench/gpu/run.sh      then one Qwen3-30B-A3B-shaped MoE layer (bench/moe.py)
# Results: a table on stdout, and in $OUT (or /tmp) bench-gpu.json and bench-gpu.md (the
# bench/RESULTS.md section). Extra arguments go to llama_bench.py (e.g. --write-results).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=.
args=()
if [[ "${SMALL:-0}" != "0" ]]; then args+=(--small); fi
out="${OUT:-/tmp}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
# 470 s: the whole run must finish in 8 minutes; what it measured by then is in the JSON.
timeout 470 python3 bench/gpu/llama_bench.py "${args[@]}" --json "$out/bench-gpu.json" \
    --markdown "$out/bench-gpu.md" "$@"
if [[ "${MOE:-0}" != "0" ]]; then
    timeout 300 python3 bench/moe.py --shape qwen3-30b-a3b --layer-only --repeats 20 \
        | tee "$out/bench-moe.md"
fi
