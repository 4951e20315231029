// check_cuda: a CUDA runtime call's error as a RuntimeError naming the call.
#pragma once
#include <cuda_runtime.h>
#include <torch/extension.h>

inline void check_cuda(cudaError_t status, const char* what) {
    TORCH_CHECK(status == cudaSuccess, "kernels_cuda: ", what, ": ", cudaGetErrorString(status));
}
