// get_dispatch_layout: tokens per expert, per rank (deduplicated), per node, and is_token_in_rank.
// Blocks are of three kinds, each counting kLayoutUnitsPerBlock consecutive units (experts, ranks
// or nodes) over all tokens in shared memory; rank blocks also write their columns of
// is_token_in_rank.
#include "device/launch.cuh"
#include "params/intranode.h"
#include "device/ptx.cuh"

namespace ep {

namespace {

enum LayoutKind : int { kExperts = 0, kRanks = 1, kNodes = 2 };

__global__ void __launch_bounds__(kLayoutThreads) get_dispatch_layout_kernel(const __grid_constant__ LayoutParams p) {
    const int expert_blocks = ceil_div(p.num_experts, kLayoutUnitsPerBlock);
    const int rank_blocks = ceil_div(p.num_ranks, kLayoutUnitsPerBlock);
    const int num_nodes = p.num_ranks / p.ranks_per_node;
    int block = static_cast<int>(blockIdx.x);
    int kind, num_units, divisor;
    int* out;
    if (block < expert_blocks) {
        kind = kExperts, num_units = p.num_experts, divisor = 1, out = p.num_tokens_per_expert;
    } else if (block < expert_blocks + rank_blocks) {
        block -= expert_blocks;
        kind = kRanks, num_units = p.num_ranks, divisor = p.num_experts / p.num_ranks, out = p.num_tokens_per_rank;
    } else {
        block -= expert_blocks + rank_blocks;
        kind = kNodes, num_units = num_nodes, divisor = p.num_experts / num_nodes, out = p.num_tokens_per_node;
    }
    const int first = block * kLayoutUnitsPerBlock;
    const int units = min(kLayoutUnitsPerBlock, num_units - first);

    EP_SHARED(int, counts, [kLayoutUnitsPerBlock]);
    if (threadIdx.x < kLayoutUnitsPerBlock) counts[threadIdx.x] = 0;
    __syncthreads();

    for (int t = threadIdx.x; t < p.num_tokens; t += blockDim.x) {
        unsigned hit = 0;  // experts are counted once per top-k slot, ranks and nodes once per token
        for (int k = 0; k < p.num_topk; ++k) {
            // Expert ids fit in 32 bits; a 32-bit division avoids the 64-bit division routine.
            const int expert = static_cast<int>(p.topk_idx[static_cast<int64_t>(t) * p.num_topk + k]);
            if (expert < 0) continue;
            const int unit = expert / divisor - first;
            if (unit < 0 || unit >= units) continue;
            if (kind == kExperts)
                atomicAdd(&counts[unit], 1);
            else
                hit |= 1u << unit;
        }
        if (kind == kExperts) continue;
        for (int u = 0; u < units; ++u) {
            const bool in = (hit >> u) & 1u;
            if (in) atomicAdd(&counts[u], 1);
            if (kind == kRanks) p.is_token_in_rank[static_cast<int64_t>(t) * p.num_ranks + first + u] = in;
        }
    }
    __syncthreads();
    if (threadIdx.x < units) out[first + threadIdx.x] = counts[threadIdx.x];
}

}  // namespace

cudaError_t launch_get_dispatch_layout(const LayoutParams& p, cudaStream_t stream) {
    const int blocks = ceil_div(p.num_experts, kLayoutUnitsPerBlock) + ceil_div(p.num_ranks, kLayoutUnitsPerBlock) +
                       ceil_div(p.num_ranks / p.ranks_per_node, kLayoutUnitsPerBlock);
    return launch(get_dispatch_layout_kernel, blocks, kLayoutThreads, stream, p, false);
}

}  // namespace ep
