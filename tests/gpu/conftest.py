"""GPU tests: skipped without CUDA or without the built extension, unless KERNELS_CUDA_REQUIRED=1
(set by run_gpu_checks.sh), which turns a missing GPU or extension into a failure."""
from __future__ import annotations

import os

import pytest
import torch

import kernels_cuda


@pytest.fixture(autouse=True)
def _needs_cuda_kernels():
    required = os.environ.get("KERNELS_CUDA_REQUIRED") == "1"
    problem = None
    if not torch.cuda.is_available():
        problem = "no CUDA device"
    elif not kernels_cuda.is_built():
        problem = kernels_cuda.build_status()
    if problem is not None:
        if required:
            pytest.fail(f"KERNELS_CUDA_REQUIRED=1 but {problem}")
        pytest.skip(problem)
