// The part of the CUDA runtime API that kernels_cuda uses, for the CPU emulation (first on the include
// path of the emulation build; no CUDA toolkit is needed). Device memory is shared memory (memory.h),
// so CUDA IPC works between processes of one machine; host-mapped memory is host memory; streams are
// emulator streams (emulator.h) and everything is synchronous: a launch runs to completion or to an
// error before it returns.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

#include "emulator.h"
#include "memory.h"

enum cudaError_t : int {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorMapBufferObjectFailed = 205,      // a peer's shared-memory segment could not be mapped
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

// The last failure's report (a launch's, or a memory call's; the emulator keeps it per OS thread), else the name.
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

// Device memory is shared memory (memory.h), so that per-process buffers can map their peers'.
inline cudaError_t memory_error(int error, const char* what) {
    if (error == 0) return cudaSuccess;
    ep_emu::set_last_report(std::string("kernels_cuda emulation: ") + what + ": " + std::strerror(error));
    return error == ENOMEM ? cudaErrorMemoryAllocation : cudaErrorMapBufferObjectFailed;
}

inline cudaError_t cudaMalloc(void** ptr, size_t bytes) {
    return memory_error(ep_emu::allocate_shared(ptr, bytes), "shared-memory allocation");
}
inline cudaError_t cudaFree(void* ptr) { return memory_error(ep_emu::free_shared(ptr), "free of a device allocation"); }
inline cudaError_t cudaMemset(void* ptr, int value, size_t bytes) {
    std::memset(ptr, value, bytes);
    return cudaSuccess;
}

// Host-mapped memory stays private to the process.
constexpr size_t kEmuAlignment = 256;
constexpr unsigned cudaHostAllocMapped = 2;
inline cudaError_t cudaHostAlloc(void** ptr, size_t bytes, unsigned) {
    *ptr = std::aligned_alloc(kEmuAlignment, (bytes + kEmuAlignment - 1) / kEmuAlignment * kEmuAlignment);
    return *ptr != nullptr ? cudaSuccess : cudaErrorMemoryAllocation;
}
inline cudaError_t cudaFreeHost(void* ptr) {
    std::free(ptr);
    return cudaSuccess;
}
inline cudaError_t cudaHostGetDevicePointer(void** device, void* host, unsigned) {
    *device = host;
    return cudaSuccess;
}

// CUDA IPC between processes of one machine: a handle names the owner's shared-memory segment.
struct cudaIpcMemHandle_t {
    char reserved[64];
};
static_assert(sizeof(ep_emu::IpcHandle) <= sizeof(cudaIpcMemHandle_t));
constexpr unsigned cudaIpcMemLazyEnablePeerAccess = 1;
inline cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t* handle, void* ptr) {
    ep_emu::IpcHandle h{};
    const cudaError_t status = memory_error(ep_emu::export_shared(ptr, &h), "IPC handle of a device allocation");
    std::memset(handle, 0, sizeof(*handle));
    std::memcpy(handle->reserved, &h, sizeof(h));
    return status;
}
inline cudaError_t cudaIpcOpenMemHandle(void** ptr, cudaIpcMemHandle_t handle, unsigned) {
    ep_emu::IpcHandle h{};
    std::memcpy(&h, handle.reserved, sizeof(h));
    return memory_error(ep_emu::map_shared(h, ptr), ("mapping the peer's buffer (process " + std::to_string(h.pid) +
                                                     ", gone or not ours?)").c_str());
}
inline cudaError_t cudaIpcCloseMemHandle(void* ptr) { return memory_error(ep_emu::unmap_shared(ptr), "unmapping a peer's buffer"); }
