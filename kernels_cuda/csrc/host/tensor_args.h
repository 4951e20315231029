// Helpers of the host bindings: CUDA error checks, tensor pointers out of per-rank dicts, and the
// text of a device timeout record.
#pragma once
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <chrono>
#include <string>
#include <thread>

#include "../ep_diag.h"
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

// Host wait for the counts a notify kernel publishes in host-mapped memory: spins until `ready(i)`
// holds for every launch rank i, or fails after `timeout_s` with the text `describe()` gives.
template <typename Ready, typename Describe>
inline void wait_for_counts(int num_launch_ranks, double timeout_s, Ready ready, Describe describe) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    for (int i = 0; i < num_launch_ranks; ++i) {
        while (!ready(i)) {
            TORCH_CHECK(std::chrono::steady_clock::now() <= deadline, describe());
            std::this_thread::yield();
        }
    }
}

// Whether a notify publishes the receive counts for the host to wait on (its dict's "publish_counts",
// default true); false for a num_worst_tokens dispatch, which allocates without them.
inline bool publishes_counts(const py::dict& d) { return !d.contains("publish_counts") || d["publish_counts"].cast<bool>(); }

// What a trapped kernel recorded: a spin loop timing out (role, rank, channel, peer and the counters it
// waited on), or a num_worst_tokens overflow.
inline std::string describe_timeout(const ep::ErrorRecord& e) {
    if (e.code == 0) return "no device timeout recorded";
    if (e.code < 0) return "a device error was being recorded when the kernel stopped";
    if (e.code == 2)
        return "num_worst_tokens too small: rank " + std::to_string(e.rank) + " receives " + std::to_string(e.tail) +
               " rows (or RDMA records), more than num_worst_tokens=" + std::to_string(e.expected);
    return "device timeout: role=" + std::to_string(e.role) + " rank=" + std::to_string(e.rank) +
           " channel=" + std::to_string(e.channel) + " peer=" + std::to_string(e.peer) +
           " head=" + std::to_string(e.head) + " tail=" + std::to_string(e.tail) +
           " expected=" + std::to_string(e.expected);
}
