// Internode (two-hop) part of kernels_cuda._C (host/internode_runtime.cpp): the runtime classes
// EmulatedInternodeRuntime and, in EP_WITH_NVSHMEM builds, NvshmemInternodeRuntime, plus the module
// attribute `with_nvshmem`.
#pragma once
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <vector>

void register_internode(pybind11::module_& m);

// get_dispatch_layout on `stream` (host/bindings.cpp): (tokens per rank, per node, per expert, is_token_in_rank).
std::vector<at::Tensor> dispatch_layout(const at::Tensor& topk_idx, int num_experts, int num_ranks, int ranks_per_node,
                                        cudaStream_t stream);
