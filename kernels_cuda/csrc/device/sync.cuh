// Cross-rank barrier and ring-metadata clean-up, shared by the notify kernels.
#pragma once
#include "params/config.h"
#include "device/diag.cuh"
#include "device/transport.cuh"

namespace ep {

// Whole-block barrier across the `num_ranks` ranks. Word [i] of rank r counts r's arrivals minus
// i's arrivals at barriers between the two: r adds 1 to its own word [i] and subtracts 1 from
// i's word [r]; r may leave once all its words are <= 0 (every peer arrived at least as often).
// The subtraction is a release and the wait an acquire, so writes before the barrier (e.g. counts
// put into peers' buffers) are visible after it. The words are never reset.
template <Backend B>
__device__ void rank_barrier(const Transport<B>& net, const BufferLayout& layout, int rank, int num_ranks,
                             long long timeout_cycles, ErrorRecord* error) {
    fence_acq_rel<Transport<B>::kScope>();
    __syncthreads();
    const int peer = static_cast<int>(threadIdx.x);
    if (peer < num_ranks) {
        net.signal_add(rank, layout.barrier + peer * 4, 1);
        net.signal_add(peer, layout.barrier + rank * 4, -1);
        SpinBudget spin(timeout_cycles);
        int value;
        while ((value = net.load_acquire(rank, layout.barrier + peer * 4)) > 0) {
            if (spin.expired()) report_timeout(error, kRoleBarrier, rank, -1, peer, value, 0, 0);
        }
    }
    __syncthreads();
}

// Zero this rank's [meta_begin, data): channel starts/ends, heads and tails of every ring.
template <Backend B>
__device__ void zero_ring_metadata(const Transport<B>& net, const BufferLayout& layout, int rank) {
    int4* words = net.template peer_ptr<int4>(rank, layout.meta_begin);
    const int64_t count = (layout.data - layout.meta_begin) / 16;
    for (int64_t i = threadIdx.x; i < count; i += blockDim.x) st_int4(words + i, make_int4(0, 0, 0, 0));
}

}  // namespace ep
