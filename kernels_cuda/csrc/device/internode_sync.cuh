// Barriers of the internode kernels: over the rail group (RDMA transport, by node) and over the GPUs
// of the node (NVLink transport, by GPU). Same counting scheme as rank_barrier (device/sync.cuh): word
// [i] of a member counts its arrivals minus member i's; a member adds 1 to its own word [i] and
// subtracts 1 from i's word [me], then waits until all its words are <= 0. Whole block; the words
// are never reset.
#pragma once
#include "device/diag.cuh"
#include "params/internode_layout.h"
#include "device/rdma.cuh"
#include "device/transport.cuh"

namespace ep {

template <Backend B>
__device__ void rail_barrier(const RdmaTransport<B>& rdma, const RdmaLayout& layout, int rank, long long timeout_cycles,
                             ErrorRecord* error) {
    rdma.quiet();  // earlier puts are delivered before the barrier's signals
    __syncthreads();
    const int me = rdma.peers.node, peer = static_cast<int>(threadIdx.x);
    if (peer < layout.num_nodes) {
        rdma.signal_add(me, layout.barrier + peer * 4, 1);
        rdma.signal_add(peer, layout.barrier + me * 4, -1);
        SpinBudget spin(timeout_cycles);
        int value;
        while ((value = rdma.load_acquire(layout.barrier + peer * 4)) > 0) {
            if (spin.expired()) report_timeout(error, kRoleRailBarrier, rank, -1, peer, value, 0, 0);
        }
    }
    __syncthreads();
}

template <Backend B>
__device__ void node_barrier(const Transport<B>& nvl, const NvlLayout& layout, int rank, int gpu, long long timeout_cycles,
                             ErrorRecord* error) {
    fence_acq_rel<Transport<B>::kScope>();
    __syncthreads();
    const int peer = static_cast<int>(threadIdx.x);
    if (peer < layout.gpus) {
        nvl.signal_add(gpu, layout.barrier + peer * 4, 1);
        nvl.signal_add(peer, layout.barrier + gpu * 4, -1);
        SpinBudget spin(timeout_cycles);
        int value;
        while ((value = nvl.load_acquire(gpu, layout.barrier + peer * 4)) > 0) {
            if (spin.expired()) report_timeout(error, kRoleNodeBarrier, rank, -1, peer, value, 0, 0);
        }
    }
    __syncthreads();
}

// Zero this rank's ring metadata (meta, heads, tails) of both regions.
template <Backend B>
__device__ void zero_internode_metadata(const RdmaTransport<B>& rdma, const Transport<nvl_backend_of<B>()>& nvl,
                                        const InternodeLayout& layout, int gpu) {
    int4* words = rdma.template local<int4>(layout.rdma.meta_begin);
    int64_t count = (layout.rdma.send_meta - layout.rdma.meta_begin) / 16;
    for (int64_t i = threadIdx.x; i < count; i += blockDim.x) st_int4(words + i, make_int4(0, 0, 0, 0));
    words = nvl.template peer_ptr<int4>(gpu, layout.nvl.meta_begin);
    count = (layout.nvl.data - layout.nvl.meta_begin) / 16;
    for (int64_t i = threadIdx.x; i < count; i += blockDim.x) st_int4(words + i, make_int4(0, 0, 0, 0));
}

}  // namespace ep
