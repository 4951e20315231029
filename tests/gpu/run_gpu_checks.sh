#!/usr/bin/env bash
# Build kernels_cuda in place and run every GPU test and benchmark in one call (sized for < 8 min on
# one H200), writing a short Markdown report to $1 (default docs/gpu_runs/<UTC date>.md) and every
# step's whole output next to it (logs-<report name>/).
# Every step runs even if an earlier one failed; the exit status is non-zero if any step failed.
# With the workplace's device tool: run `bash tests/gpu/run_gpu_checks.sh "$OUT/gpu_checks.md"` with
# timeout_s 560 (the logs come back in $OUT/logs-gpu_checks/), then commit the report under docs/gpu_runs/.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPORT="${1:-docs/gpu_runs/$(date -u +%Y-%m-%d).md}"
mkdir -p "$(dirname "$REPORT")"
LOGS="$(dirname "$REPORT")/logs-$(basename "$REPORT" .md)"  # every step's whole output
mkdir -p "$LOGS"
export MOE_TRAIN_BUILD_CUDA=1 KERNELS_CUDA_REQUIRED=1 PYTHONUNBUFFERED=1
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"  # the interpreter that holds torch
# One line per test as it ends (a step killed at its limit still shows how far it got) and, where
# pytest-timeout is installed, a per-test limit so one hanging test does not take the whole step.
PYTEST=("$PYTHON" -m pytest -v -rfE -p no:cacheprovider)
"$PYTHON" -c "import pytest_timeout" 2>/dev/null && PYTEST+=(--timeout 40)
export MAX_JOBS="${MAX_JOBS:-16}" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
FAILED=0
ROWS=""

step() {  # step NAME TIMEOUT_S COMMAND...
    local name="$1" limit="$2"; shift 2
    local start rc
    start=$(date +%s)
    echo "=== $name: $*"
    timeout --kill-after=10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
    rc=$?
    tail -n 60 "$LOGS/$name.log"
    echo "=== $name: rc=$rc in $(( $(date +%s) - start )) s"
    [ "$rc" -ne 0 ] && FAILED=1
    ROWS+="| $name | $rc | $(( $(date +%s) - start )) s |"$'\n'
}

# Most telling first: the bf16 training step (no kernels_cuda needed; again with selective recompute), the FP8
# GEMMs against bf16 at DeepSeek-V3's shapes and the fp8 training step (train.precision=fp8; again with the
# selective recompute, the 671B recipe's way to fit in 80 GiB), then the kernels on the GPU
# (the CUDA runs of tests/kernels, which CI runs on the CPU emulation), then the per-process buffers,
# then logging.memory_snapshot's CUDA run (a 2-step tiny run, about 15 s), then the benchmarks. Limits sum to
# 740 s (expected total about 6 min: the device code compiles in seconds, the host sources with torch's headers
# take most of the build, which took 50-60 s on 2 cores without a GPU, see docs/cuda_build_without_gpu.md);
# compile_check is left to CI.
step environment 15 bash -c 'nvidia-smi; nvidia-smi --query-gpu=compute_mode --format=csv; nvcc --version; "$0" -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"; git rev-parse HEAD 2>/dev/null || echo "(no git checkout)"; git status --short 2>/dev/null | head -20' "$PYTHON"
step train_bf16 75 "$PYTHON" -m tests.gpu.bench_training
step train_recompute 50 "$PYTHON" -m tests.gpu.bench_training --steps 2 --set "model.recompute_modules=[layernorm,mla_up_proj,moe_act]"
step fp8_gemm 30 "$PYTHON" -m tests.gpu.bench_fp8_gemm
step train_fp8 60 "$PYTHON" -m tests.gpu.bench_training --steps 2 --set train.precision=fp8
step train_fp8_recompute 60 "$PYTHON" -m tests.gpu.bench_training --steps 2 --set train.precision=fp8 --set "model.recompute_modules=[layernorm,mla_up_proj,moe_act]"
step build 100 "$PYTHON" -m kernels_cuda.build
step import 10 "$PYTHON" -c "import kernels_cuda; print(kernels_cuda.build_status()); assert kernels_cuda.is_built()"
step tests_kernels 90 "${PYTEST[@]}" tests/kernels -k cuda
step tests_gpu 70 "${PYTEST[@]}" tests/gpu --ignore=tests/gpu/test_buffer_processes.py --ignore=tests/gpu/test_memory_snapshot.py
step tests_processes 60 "${PYTEST[@]}" tests/gpu/test_buffer_processes.py
step memory_snapshot 40 "${PYTEST[@]}" -s tests/gpu/test_memory_snapshot.py
step bench 20 "$PYTHON" -m tests.gpu.bench_emulated
step bench_internode 20 "$PYTHON" -m tests.gpu.bench_internode
step bench_overlap 20 "$PYTHON" -m tests.gpu.bench_overlap
step bench_low_latency 20 "$PYTHON" benchmarks/low_latency_kernels.py --device cuda --tokens 128 --hidden 7168

{
    echo "# GPU checks $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    echo "Commit \`$(git rev-parse --short HEAD 2>/dev/null || echo unknown)\` ($(git status --short 2>/dev/null | wc -l) changed files)."
    echo "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
    echo
    echo "| step | rc | time |"
    echo "|---|---|---|"
    printf '%s' "$ROWS"
    for name in train_bf16 train_recompute fp8_gemm train_fp8 train_fp8_recompute tests_kernels tests_gpu tests_processes memory_snapshot bench bench_internode bench_overlap bench_low_latency; do
        echo
        echo "## $name"
        echo '```'
        tail -n 200 "$LOGS/$name.log" 2>/dev/null
        echo '```'
    done
    if [ "$FAILED" -ne 0 ]; then
        echo
        echo "## logs of failed steps"
        for log in "$LOGS"/*.log; do
            echo "### $(basename "$log")"
            echo '```'
            tail -n 80 "$log"
            echo '```'
        done
    fi
} >"$REPORT"
echo "report: $REPORT (full logs in $LOGS)"
exit "$FAILED"
