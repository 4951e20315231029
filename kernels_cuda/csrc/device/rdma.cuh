// RDMA transport of the internode kernels: the hop between rail peers (same GPU index, other node).
// Same contract as device/transport.cuh, addressed by node:
//   put_warp(node, dst, src, n)  the warp copies n int4 from local memory to `dst` in the node's region;
//   signal_add(node, word, v)    atomic add, ordered after every earlier put of the calling warp to that
//                                node (RDMA: same QP; here: fence, warp sync, release atomic), so a
//                                tail published this way covers the data;
//   load_acquire(word)           poll a word of the local region (everybody polls only local memory).
// Back ends:
//   kEmulated: every node's rail peer is a slice of one GPU allocation (tests on one GPU);
//   kNvshmem:  the region is NVSHMEM's symmetric heap, PE = node * gpus + gpu (host set-up:
//              host/nvshmem_world.cu and NvshmemInternodeRuntime in host/internode_runtime.cpp).
//              Compiled only with EP_WITH_NVSHMEM (kernels_cuda/build.py); compile_check compiles and
//              device-links it against libnvshmem_device, but it has never run (no multi-node GPUs).
#pragma once
#include <cstdint>

#include "params/internode.h"
#include "device/ptx.cuh"

#if defined(EP_WITH_NVSHMEM)
#include <nvshmem.h>
#include <nvshmemx.h>
#endif

namespace ep {

template <Backend B>
struct RdmaTransport;

// The rail peers' regions reached through plain pointers: slices of one allocation (kEmulated, GPU
// scope) or CUDA IPC mappings of other processes' regions (kNvlink, system scope: "nodes" that
// share one machine, e.g. simulated nodes or tests of the per-process path on one box).
template <Backend B>
struct PointerRdmaTransport {
    static constexpr Scope kScope = B == Backend::kEmulated ? Scope::kGpu : Scope::kSys;
    const InternodePeers& peers;

    __device__ __forceinline__ explicit PointerRdmaTransport(const InternodePeers& p) : peers(p) {}

    template <typename T = uint8_t>
    __device__ __forceinline__ T* local(int64_t offset) const {
        return reinterpret_cast<T*>(peers.rdma[peers.node] + offset);
    }

    __device__ __forceinline__ void put_warp(int node, int64_t offset, const int4* src, int num_int4) const {
        int4* dst = reinterpret_cast<int4*>(peers.rdma[node] + offset);
        for (int i = lane_id(); i < num_int4; i += 32) st_int4(dst + i, ld_int4(src + i));
    }

    // Called by the whole warp after its puts; lane 0 adds.
    __device__ __forceinline__ void signal_add_warp(int node, int64_t offset, int value) const {
        fence_acq_rel<kScope>();
        __syncwarp();
        if (lane_id() == 0) atomic_add_release<kScope>(reinterpret_cast<int*>(peers.rdma[node] + offset), value);
    }

    // A single lane's atomic (head updates carry no data).
    __device__ __forceinline__ void signal_add(int node, int64_t offset, int value) const {
        atomic_add_release<kScope>(reinterpret_cast<int*>(peers.rdma[node] + offset), value);
    }

    __device__ __forceinline__ int load_acquire(int64_t offset) const { return ld_acquire<kScope>(local<int>(offset)); }
    __device__ __forceinline__ void quiet() const { fence_acq_rel<kScope>(); }
};

template <>
struct RdmaTransport<Backend::kEmulated> : PointerRdmaTransport<Backend::kEmulated> {
    using PointerRdmaTransport::PointerRdmaTransport;
};
template <>
struct RdmaTransport<Backend::kNvlink> : PointerRdmaTransport<Backend::kNvlink> {
    using PointerRdmaTransport::PointerRdmaTransport;
};

#if defined(EP_WITH_NVSHMEM)
template <>
struct RdmaTransport<Backend::kNvshmem> {
    static constexpr Scope kScope = Scope::kSys;
    const InternodePeers& peers;  // rdma[*] all hold this PE's symmetric base (same address on every PE)

    __device__ __forceinline__ explicit RdmaTransport(const InternodePeers& p) : peers(p) {}

    template <typename T = uint8_t>
    __device__ __forceinline__ T* local(int64_t offset) const {
        return reinterpret_cast<T*>(peers.rdma[peers.node] + offset);
    }
    __device__ __forceinline__ int pe(int node) const { return node * peers.gpus + peers.gpu; }

    __device__ __forceinline__ void put_warp(int node, int64_t offset, const int4* src, int num_int4) const {
        nvshmemx_putmem_nbi_warp(local(offset), src, static_cast<size_t>(num_int4) * 16, pe(node));
    }
    __device__ __forceinline__ void signal_add_warp(int node, int64_t offset, int value) const {
        __syncwarp();
        if (lane_id() == 0) {
            nvshmem_fence();  // the puts to this PE are delivered before the tail
            nvshmem_int_atomic_add(local<int>(offset), value, pe(node));
        }
    }
    __device__ __forceinline__ void signal_add(int node, int64_t offset, int value) const {
        nvshmem_int_atomic_add(local<int>(offset), value, pe(node));
    }
    __device__ __forceinline__ int load_acquire(int64_t offset) const { return ld_acquire<kScope>(local<int>(offset)); }
    __device__ __forceinline__ void quiet() const { nvshmem_quiet(); }
};
#endif

// The NVLink back end that goes with an RDMA back end: emulated ranks share one GPU.
template <Backend B>
constexpr Backend nvl_backend_of() {
    return B == Backend::kEmulated ? Backend::kEmulated : Backend::kNvlink;
}

}  // namespace ep
