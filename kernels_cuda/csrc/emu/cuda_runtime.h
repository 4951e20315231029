// The part of the CUDA runtime API that kernels_cuda uses, for the CPU emulation (first on the include
// path of the emulation build; no CUDA toolkit is needed). Device memory and host-mapped memory are
// host memory, streams are emulator streams (emulator.h) and everything is synchronous: a launch runs
// to completion or to an error before it returns.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "emulator.h"

enum cudaError_t : int {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorLaunchTimeout = 702,              // the emulator found a deadlock
    cudaErrorIllegalInstruction = 715,         // a barrier or warp collective used wrongly
    cudaErrorLaunchFailure = 719,              // __trap
    cudaErrorCooperativeLaunchTooLarge = 720,  // more blocks than SMs
    cudaErrorNotSupported = 801,
};

using cudaStream_t = ep_emu::Stream*;

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
};

struct alignas(16) int4 {
    int x, y, z, w;
};
inline int4 make_int4(int x, int y, int z, int w) { return int4{x, y, z, w}; }
struct alignas(8) float2 {
    float x, y;
};

enum cudaLaunchAttributeID : int { cudaLaunchAttributeCooperative = 2 };
union cudaLaunchAttributeValue {
    int cooperative;
};
struct cudaLaunchAttribute {
    cudaLaunchAttributeID id;
    cudaLaunchAttributeValue val;
};
struct cudaLaunchConfig_t {
    dim3 gridDim;
    dim3 blockDim;
    size_t dynamicSmemBytes;
    cudaStream_t stream;
    cudaLaunchAttribute* attrs;
    unsigned numAttrs;
};

// Launches `kernel` on the emulator; the kernel is named in reports by its parameter type.
template <typename Params>
inline cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t* config, void (*kernel)(Params), Params params) {
    bool cooperative = false;
    for (unsigned i = 0; i < config->numAttrs; ++i)
        cooperative |= config->attrs[i].id == cudaLaunchAttributeCooperative && config->attrs[i].val.cooperative != 0;
    struct Call {
        void (*kernel)(Params);
        const Params* params;
    };
    const Call call{kernel, &params};
    const int status = ep_emu::launch(
        __PRETTY_FUNCTION__, static_cast<int>(config->gridDim.x), static_cast<int>(config->blockDim.x), config->stream,
        cooperative, [](const void* c) { static_cast<const Call*>(c)->kernel(*static_cast<const Call*>(c)->params); },
        &call);
    return static_cast<cudaError_t>(status);
}

inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }

// The last failed launch's report for its code (the emulator keeps it per OS thread), else the name.
inline const char* cudaGetErrorString(cudaError_t error) {
    if (error != cudaSuccess && !ep_emu::last_report().empty()) return ep_emu::last_report().c_str();
    switch (error) {
        case cudaSuccess: return "no error";
        case cudaErrorInvalidValue: return "invalid argument";
        case cudaErrorMemoryAllocation: return "out of memory";
        case cudaErrorNotSupported: return "operation not supported (CPU emulation)";
        default: return "emulated launch failed";
    }
}

constexpr size_t kEmuAlignment = 256;  // cudaMalloc's alignment

inline cudaError_t cudaMalloc(void** ptr, size_t bytes) {
    *ptr = std::aligned_alloc(kEmuAlignment, (bytes + kEmuAlignment - 1) / kEmuAlignment * kEmuAlignment);
    return *ptr != nullptr ? cudaSuccess : cudaErrorMemoryAllocation;
}
inline cudaError_t cudaFree(void* ptr) {
    std::free(ptr);
    return cudaSuccess;
}
inline cudaError_t cudaMemset(void* ptr, int value, size_t bytes) {
    std::memset(ptr, value, bytes);
    return cudaSuccess;
}

constexpr unsigned cudaHostAllocMapped = 2;
inline cudaError_t cudaHostAlloc(void** ptr, size_t bytes, unsigned) { return cudaMalloc(ptr, bytes); }
inline cudaError_t cudaFreeHost(void* ptr) { return cudaFree(ptr); }
inline cudaError_t cudaHostGetDevicePointer(void** device, void* host, unsigned) {
    *device = host;
    return cudaSuccess;
}

// CUDA IPC has no meaning in one process; per-process buffers on the CPU use shared memory instead.
struct cudaIpcMemHandle_t {
    char reserved[64];
};
constexpr unsigned cudaIpcMemLazyEnablePeerAccess = 1;
inline cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t*, void*) { return cudaErrorNotSupported; }
inline cudaError_t cudaIpcOpenMemHandle(void**, cudaIpcMemHandle_t, unsigned) { return cudaErrorNotSupported; }
inline cudaError_t cudaIpcCloseMemHandle(void*) { return cudaErrorNotSupported; }
