// CUDA IPC for buffers shared by the GPUs of a node: a cudaMalloc'ed base travels as the raw bytes
// of its cudaIpcMemHandle_t (all-gathered with torch.distributed) and is opened by each peer.
#pragma once
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "tensor_args.h"

inline py::bytes ipc_handle_of(void* base) {
    cudaIpcMemHandle_t handle;
    check_cuda(cudaIpcGetMemHandle(&handle, base), "cudaIpcGetMemHandle");
    return py::bytes(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

// This process's mapping of a peer's buffer; close it with cudaIpcCloseMemHandle.
inline uint8_t* open_ipc_handle(const std::string& raw) {
    TORCH_CHECK(raw.size() == sizeof(cudaIpcMemHandle_t), "kernels_cuda: malformed IPC handle");
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, raw.data(), sizeof(handle));
    void* mapped = nullptr;
    check_cuda(cudaIpcOpenMemHandle(&mapped, handle, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
    return static_cast<uint8_t*>(mapped);
}
