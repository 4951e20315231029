// Device-side transport used by every kernel. A rank reaches a peer through the peer's buffer
// base pointer (EMULATED: slices of one allocation; NVLINK: CUDA IPC mappings), so:
//   put    = a warp's 16-byte-vector copy into the peer's buffer,
//   signal = a release store / release atomic add on a word of the peer's buffer, issued after
//            the writers' fences and a barrier, hence ordered after every earlier put of the
//            channel (data and tail travel together, heads on their own words),
//   quiet  = a fence at the back end's scope.
// NVSHMEM is not a back end of this transport: it carries only the internode kernels' RDMA hop
// (RdmaTransport<kNvshmem> in device/rdma.cuh); their NVLink hop uses Transport<kNvlink>.
#pragma once
#include <cstdint>

#include "params/constants.h"
#include "params/intranode.h"
#include "device/ptx.cuh"

namespace ep {

template <Backend B>
struct TransportScope;
template <>
struct TransportScope<Backend::kEmulated> {
    static constexpr Scope value = Scope::kGpu;
};
template <>
struct TransportScope<Backend::kNvlink> {
    static constexpr Scope value = Scope::kSys;
};

template <Backend B>
struct Transport {
    static constexpr Scope kScope = TransportScope<B>::value;
    uint8_t* const* peers;

    __device__ __forceinline__ explicit Transport(uint8_t* const* peer_table) : peers(peer_table) {}

    template <typename T = uint8_t>
    __device__ __forceinline__ T* peer_ptr(int rank, int64_t offset) const {
        return reinterpret_cast<T*>(peers[rank] + offset);
    }

    // The calling warp copies `num_int4` 16-byte words; `src` and the destination are 16-byte aligned.
    __device__ __forceinline__ void put_warp(int rank, int64_t offset, const int4* src, int num_int4) const {
        int4* dst = peer_ptr<int4>(rank, offset);
        constexpr int kUnroll = 4;
        int i = lane_id();
        for (; i + (kUnroll - 1) * 32 < num_int4; i += kUnroll * 32) {
            int4 v[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) v[u] = ld_int4(src + i + u * 32);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) st_int4(dst + i + u * 32, v[u]);
        }
        for (; i < num_int4; i += 32) st_int4(dst + i, ld_int4(src + i));
    }

    __device__ __forceinline__ void signal_store(int rank, int64_t offset, int value) const {
        st_release<kScope>(peer_ptr<int>(rank, offset), value);
    }
    __device__ __forceinline__ int signal_add(int rank, int64_t offset, int value) const {
        return atomic_add_release<kScope>(peer_ptr<int>(rank, offset), value);
    }
    __device__ __forceinline__ int load_acquire(int rank, int64_t offset) const {
        return ld_acquire<kScope>(peer_ptr<int>(rank, offset));
    }
    __device__ __forceinline__ void quiet() const { fence_acq_rel<kScope>(); }
};

}  // namespace ep
