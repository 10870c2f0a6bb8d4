#!/usr/bin/env bash
# The device benchmarks in one go, for the GPU machine (no network; installs nothing):
#   bash bench/gpu/run.sh                 attention.py (attention alone, ~4 minutes), then
#                                         llama_bench.py (Llama-3-8B shape, random bf16 weights)
#   BENCH=kernels bash bench/gpu/run.sh   only attention.py; BENCH=llama only llama_bench.py
#   SMALL=1 bash bench/gpu/run.sh         shrunk workloads, e.g. on a CPU to test the scripts
#   MOE=1 bash bench/gpu/run.sh           then one Qwen3-30B-A3B-shaped MoE layer (bench/moe.py)
# Results: tables on stdout, and in $OUT (or /tmp) bench-gpu-kernels.{json,md},
# bench-gpu.{json,md} (the bench/RESULTS.md sections) and bench-moe.md. Extra arguments go to
# attention.py and llama_bench.py (e.g. --write-results). attention.py exits non-zero if any kernel
# output differs from the reference; the script then stops there.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=.
args=()
if [[ "${SMALL:-0}" != "0" ]]; then args+=(--small); fi
out="${OUT:-/tmp}"
bench="${BENCH:-all}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
if [[ "$bench" == "all" || "$bench" == "kernels" ]]; then
    # 240 s: the kernels stop starting new cases at 200 s; what they measured is in the JSON.
    timeout 240 python3 bench/gpu/attention.py "${args[@]}" --json "$out/bench-gpu-kernels.json" \
        --markdown "$out/bench-gpu-kernels.md" "$@"
fi
if [[ "$bench" == "all" || "$bench" == "llama" ]]; then
    # 470 s: the whole step benchmark must finish in 8 minutes.
    timeout 470 python3 bench/gpu/llama_bench.py "${args[@]}" --json "$out/bench-gpu.json" \
        --markdown "$out/bench-gpu.md" "$@"
fi
if [[ "${MOE:-0}" != "0" ]]; then
    timeout 300 python3 bench/moe.py --shape qwen3-30b-a3b --layer-only --repeats 20 \
        | tee "$out/bench-moe.md"
fi
