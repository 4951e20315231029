// Launch helper: the intranode kernels spin on each other across blocks (and, emulated, across
// ranks of one grid), so every block must be resident at once: launch cooperatively, which fails
// with cudaErrorCooperativeLaunchTooLarge instead of hanging when the grid does not fit.
#pragma once
#include <cuda_runtime.h>

namespace ep {

template <typename Params>
inline cudaError_t launch_cooperative(void (*kernel)(Params), int blocks, int threads, cudaStream_t stream,
                                      const Params& params) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(blocks);
    config.blockDim = dim3(threads);
    config.dynamicSmemBytes = 0;
    config.stream = stream;
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeCooperative;
    attribute[0].val.cooperative = 1;
    config.attrs = attribute;
    config.numAttrs = 1;
    return cudaLaunchKernelEx(&config, kernel, params);
}

}  // namespace ep
