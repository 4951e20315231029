"""The kernel tests: the CPU emulation is built once here when it is missing or stale (a C++ compiler is
all it needs), so `python -m pytest tests` runs every emulated-group test on CPU; CUDA runs need a GPU
and the CUDA build. A machine without a compiler skips the CPU runs and says why; KERNELS_CUDA_REQUIRED=1
(tests/gpu/run_gpu_checks.sh) turns a missing GPU or build into a failure."""
from __future__ import annotations

import os

import pytest
import torch

import kernels_cuda
from kernels_cuda import build_cpu

_BUILD_PROBLEM = build_cpu.ensure_built()


def skip_reason(device: str) -> str | None:
    """Why runs on `device` cannot happen here (None: they can)."""
    if device == "cpu":
        if _BUILD_PROBLEM is not None:
            return f"the CPU emulation cannot be built here: {_BUILD_PROBLEM}"
        return None if kernels_cuda.is_built("cpu") else kernels_cuda.build_status()
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None if kernels_cuda.is_built("cuda") else kernels_cuda.build_status()


@pytest.fixture(autouse=True)
def _device_available(request):
    """A test's `run` parameter (tests/kernels/runs.py) names its device: skip the run (or, with
    KERNELS_CUDA_REQUIRED=1 on CUDA, fail it) when that device is not available; print its schedule."""
    run = getattr(getattr(request.node, "callspec", None), "params", {}).get("run")
    if run is None:
        return
    problem = skip_reason(run.device)
    if problem is not None:
        if run.device == "cuda" and os.environ.get("KERNELS_CUDA_REQUIRED") == "1":
            pytest.fail(f"KERNELS_CUDA_REQUIRED=1 but {problem}")
        pytest.skip(problem)
    print(f"run: {run.id}")
