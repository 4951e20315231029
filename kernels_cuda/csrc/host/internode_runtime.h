// Internode (two-hop) part of kernels_cuda._C (host/internode_runtime.cpp): registers the runtime
// classes InternodeRuntime, EmulatedInternodeRuntime, ProcessInternodeRuntime, IpcInternodeRuntime and,
// in EP_WITH_NVSHMEM builds, NvshmemInternodeRuntime, plus the module attribute `with_nvshmem`.
#pragma once
#include <torch/extension.h>

void register_internode(pybind11::module_& m);
