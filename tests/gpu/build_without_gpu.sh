#!/usr/bin/env bash
# Build kernels_cuda against a CUDA build of torch on a machine WITHOUT a GPU, with and without the
# NVSHMEM back end, and load each build: catches build and link errors (undefined symbols, missing
# libraries, import order) before a GPU session is spent on them. Needs nvcc and network or a local
# wheel cache; the virtual environment (a CUDA torch, several GB) is made once and reused.
# Usage: bash tests/gpu/build_without_gpu.sh [VENV_DIR]   (TORCH_SPEC may name the torch to install)
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${1:-${TMPDIR:-/tmp}/moe-train-cuda-venv}"
TORCH_SPEC="${TORCH_SPEC:-torch}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q "$TORCH_SPEC" setuptools ninja nvidia-nvshmem-cu13
"$VENV/bin/python" -c "import torch; assert torch.version.cuda, 'TORCH_SPEC must name a CUDA build'; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
nvcc --version | tail -1
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
git ls-files -co --exclude-standard | tar -cf - -T - | tar -xf - -C "$WORK"
for nvshmem in 0 1; do
    rm -rf "$WORK/build" "$WORK"/kernels_cuda/_C*.so
    start=$(date +%s)
    (cd "$WORK" && MOE_TRAIN_BUILD_CUDA=1 MOE_TRAIN_NVSHMEM=$nvshmem "$VENV/bin/python" -m kernels_cuda.build >build.log 2>&1) \
        || { tail -n 60 "$WORK/build.log"; exit 1; }
    echo "== MOE_TRAIN_NVSHMEM=$nvshmem: built in $(( $(date +%s) - start )) s"
    (cd "$WORK" && "$VENV/bin/python" - <<'PY'
import ctypes

import kernels_cuda

assert kernels_cuda.is_built(), kernels_cuda.build_status()
ext = kernels_cuda.require_built()
print("loads:", kernels_cuda.build_status(), "| with_nvshmem:", ext.with_nvshmem)
print("classes:", ", ".join(n for n in dir(ext) if not n.startswith("_")))
if ext.with_nvshmem:  # host-only NVSHMEM calls work without a GPU
    unique_id = ext.NvshmemInternodeRuntime.unique_id(1 << 30)
    libc = ctypes.CDLL(None)
    libc.getenv.restype = ctypes.c_char_p
    print(f"NVSHMEM unique id: {len(unique_id)} bytes; NVSHMEM_SYMMETRIC_SIZE for 1 GiB of RDMA buffer: "
          f"{libc.getenv(b'NVSHMEM_SYMMETRIC_SIZE').decode()}")
PY
    )
done
