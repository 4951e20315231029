// Internode (two-hop) part of kernels_cuda._C (host/internode_runtime.cpp): the runtime classes
// EmulatedInternodeRuntime and, in EP_WITH_NVSHMEM builds, NvshmemInternodeRuntime, plus the module
// attribute `with_nvshmem`.
#pragma once
#include <torch/extension.h>

void register_internode(pybind11::module_& m);
