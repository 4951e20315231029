// Launch helper: the intranode kernels spin on each other across blocks (and, emulated, across
// ranks of one grid), so every block must be resident at once: launch cooperatively, which fails
// with cudaErrorCooperativeLaunchTooLarge instead of hanging when the grid does not fit.
#pragma once
#include <cuda_runtime.h>

#include "params/intranode.h"

namespace ep {

// Every launch goes through cudaLaunchKernelEx (no `<<<>>>`), which the CPU emulation provides too.
template <typename Params>
inline cudaError_t launch(void (*kernel)(Params), int blocks, int threads, cudaStream_t stream, const Params& params,
                          bool cooperative) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(blocks);
    config.blockDim = dim3(threads);
    config.dynamicSmemBytes = 0;
    config.stream = stream;
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeCooperative;
    attribute[0].val.cooperative = 1;
    config.attrs = attribute;
    config.numAttrs = cooperative ? 1 : 0;
    return cudaLaunchKernelEx(&config, kernel, params);
}

template <typename Params>
inline cudaError_t launch_cooperative(void (*kernel)(Params), int blocks, int threads, cudaStream_t stream,
                                      const Params& params) {
    return launch(kernel, blocks, threads, stream, params, true);
}

// Internode launches: the EMULATED and the IPC (kNvlink: one rank per process, every hop through
// CUDA IPC pointers) kernels always exist, the NVSHMEM one only in builds with EP_WITH_NVSHMEM
// (else nullptr: the launch reports cudaErrorNotSupported).
template <typename T>
struct Same {
    using type = T;
};

template <typename Params>
inline cudaError_t launch_by_backend(Backend backend, void (*emulated)(Params),
                                     typename Same<void (*)(Params)>::type ipc,
                                     typename Same<void (*)(Params)>::type nvshmem, int blocks, int threads,
                                     cudaStream_t stream, const Params& params) {
    if (backend == Backend::kEmulated) return launch_cooperative(emulated, blocks, threads, stream, params);
    if (backend == Backend::kNvlink) return launch_cooperative(ipc, blocks, threads, stream, params);
    if (backend != Backend::kNvshmem || nvshmem == nullptr) return cudaErrorNotSupported;
    return launch_cooperative(nvshmem, blocks, threads, stream, params);
}

#if defined(EP_WITH_NVSHMEM)
#define EP_NVSHMEM_KERNEL(...) __VA_ARGS__
#else
#define EP_NVSHMEM_KERNEL(...) nullptr
#endif

}  // namespace ep
