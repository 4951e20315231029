// Helpers of the host bindings: CUDA error checks and the arguments of a launch rank out of its dict
// (tensor pointers, whether it publishes its receive counts).
#pragma once
#include <cuda_runtime.h>
#include <torch/extension.h>

#include "device_api.h"

namespace py = pybind11;

inline void check_cuda(cudaError_t status, const char* what) {
    TORCH_CHECK(status == cudaSuccess, "kernels_cuda: ", what, ": ", cudaGetErrorString(status));
}

template <typename T>
inline T* ptr_or_null(const py::dict& d, const char* key) {
    if (!d.contains(key) || d[key].is_none()) return nullptr;
    auto t = d[key].cast<at::Tensor>();
    TORCH_CHECK(on_launch_device(t), "kernels_cuda: tensor '", key, "' must be on the ", kLaunchDevice);
    return static_cast<T*>(t.data_ptr());
}

// A required tensor; an empty one (a rank that receives nothing) has a null data pointer, which the
// kernels never dereference.
template <typename T>
inline T* ptr(const py::dict& d, const char* key) {
    TORCH_CHECK(d.contains(key) && !d[key].is_none(), "kernels_cuda: missing tensor '", key, "'");
    return ptr_or_null<T>(d, key);
}

// Whether a notify publishes the receive counts for the host to wait on (its dict's "publish_counts",
// default true); false for a num_worst_tokens dispatch, which allocates without them.
inline bool publishes_counts(const py::dict& d) { return !d.contains("publish_counts") || d["publish_counts"].cast<bool>(); }
