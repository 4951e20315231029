// Internode (two-hop) part of kernels_cuda._C: the EmulatedInternodeRuntime class (host/internode_runtime.cpp).
#pragma once
#include <torch/extension.h>

void register_internode(pybind11::module_& m);
