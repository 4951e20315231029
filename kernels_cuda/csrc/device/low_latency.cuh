// Device helpers of the low-latency kernels: their transport, where a half's parts live, the e4m3 cast
// (bit-exact with torch's float8_e4m3fn, round to nearest even), the exact power-of-two scale, the float
// operations the combine sums with (never contracted into FMAs: the sums must equal the reference's),
// and the zeroing of the next half that every op starts with.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "device/diag.cuh"
#include "params/low_latency.h"
#include "device/ptx.cuh"
#include "device/ring.cuh"
#include "device/transport.cuh"

#if defined(EP_WITH_NVSHMEM)
#include <nvshmem.h>
#include <nvshmemx.h>
#endif

namespace ep {

constexpr int kLowLatencyThreads = kLowLatencyWarps * 32;

// How a rank reaches its peers' regions: the intranode kernels' peer stores (kEmulated: slices of one
// allocation; kNvlink: CUDA IPC or, on the CPU emulation, shared memory), or, between machines,
// NVSHMEM (kNvshmem: every region at the same symmetric address, PE = EP rank). Each has
// peer_ptr(me, offset) for this rank's own region, put_warp (a warp's copy into a peer's region),
// quiet (this thread's puts delivered), signal_store / signal_add (a release store / add on a peer's
// word, after the quiet of the puts it covers) and kScope (of the polls on this rank's own words).
template <Backend B>
struct LowLatencyTransport : Transport<B> {
    using Transport<B>::Transport;
};

#if defined(EP_WITH_NVSHMEM)
// Compiled and device-linked by compile_check; it has never run (no GPUs across machines here). Sources
// of puts must be symmetric: the dispatch stages its messages in the region, the combine's input is the
// region's zero-copy buffer (kernels_cuda/low_latency.py copies it there).
template <>
struct LowLatencyTransport<Backend::kNvshmem> {
    static constexpr Scope kScope = Scope::kSys;
    uint8_t* const* peers;  // every entry is this PE's symmetric base

    __device__ __forceinline__ explicit LowLatencyTransport(uint8_t* const* peer_table) : peers(peer_table) {}

    template <typename T = uint8_t>
    __device__ __forceinline__ T* peer_ptr(int /*own rank*/, int64_t offset) const {
        return reinterpret_cast<T*>(peers[0] + offset);
    }
    __device__ __forceinline__ void put_warp(int rank, int64_t offset, const int4* src, int num_int4) const {
        nvshmemx_putmem_nbi_warp(peer_ptr(rank, offset), src, static_cast<size_t>(num_int4) * 16, rank);
    }
    __device__ __forceinline__ void quiet() const { nvshmem_quiet(); }
    __device__ __forceinline__ void signal_store(int rank, int64_t offset, int value) const {
        nvshmem_fence();
        nvshmem_int_atomic_set(peer_ptr<int>(rank, offset), value, rank);
    }
    __device__ __forceinline__ int signal_add(int rank, int64_t offset, int value) const {
        nvshmem_fence();
        return nvshmem_int_atomic_fetch_add(peer_ptr<int>(rank, offset), value, rank);
    }
};
#endif
constexpr float kE4m3Max = 448.0f;
constexpr float kAmaxFloor = 1e-4f;

__device__ __forceinline__ float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}
__device__ __forceinline__ float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}
__device__ __forceinline__ float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}

// |value| <= 448 (the caller clamps), not NaN.
__device__ __forceinline__ uint32_t float_to_e4m3(float value) {
    const uint32_t bits = static_cast<uint32_t>(__float_as_int(value));
    const uint32_t sign = (bits >> 24) & 0x80u;
    const uint32_t magnitude = bits & 0x7fffffffu;
    const float a = __int_as_float(static_cast<int>(magnitude));
    if (a < 0.015625f) {  // below 2^-6: subnormal e4m3, multiples of 2^-9 (8 * 2^-9 is 2^-6's encoding)
        const float units = a * 512.0f;  // exact, in [0, 8)
        uint32_t q = static_cast<uint32_t>(units);
        const float fraction = units - static_cast<float>(q);  // exact
        if (fraction > 0.5f || (fraction == 0.5f && (q & 1u))) ++q;
        return sign | q;
    }
    int exponent = static_cast<int>(magnitude >> 23) - 127;
    uint32_t mantissa = (magnitude & 0x7fffffu) >> 20;
    const uint32_t rest = magnitude & 0xfffffu;
    if (rest > 0x80000u || (rest == 0x80000u && (mantissa & 1u))) ++mantissa;
    if (mantissa == 8u) mantissa = 0u, ++exponent;
    return sign | (static_cast<uint32_t>(exponent + 7) << 3) | mantissa;
}

// 2^ceil(log2(scale)) of a positive normal float, from its bits.
__device__ __forceinline__ float power_of_two_ceil(float scale) {
    const int bits = __float_as_int(scale);
    const int exponent = ((bits >> 23) & 0xff) + ((bits & 0x7fffff) != 0 ? 1 : 0);
    return __int_as_float(exponent << 23);
}

__device__ __forceinline__ int64_t half_offset(const LowLatencyParams& p, int half) {
    return static_cast<int64_t>(half) * p.layout.half_bytes;
}

// Block 0 of each rank zeroes the signals of the half the next op uses (nobody writes them before
// every rank started this op: see low_latency.py), then publishes the clean word; a rank's signals
// to its peers wait for it, so no peer sees this op's signals before the next half is clean.
__device__ __forceinline__ void clean_next_half(const LowLatencyParams& p, uint8_t* own, int block) {
    if (block != 0) return;
    int* signals = reinterpret_cast<int*>(own + half_offset(p, p.half ^ 1) + p.layout.dispatch_count);
    for (int i = threadIdx.x; i < 2 * p.num_experts; i += blockDim.x) st_plain(signals + i, 0);
    __syncthreads();
    if (threadIdx.x == 0) st_release<Scope::kGpu>(reinterpret_cast<int*>(own + p.layout.clean_word), p.seq);
}

__device__ __forceinline__ void wait_for_clean(const LowLatencyParams& p, const uint8_t* own, const WaitContext& ctx) {
    const int* word = reinterpret_cast<const int*>(own + p.layout.clean_word);
    SpinBudget spin(ctx.timeout_cycles);
    int seen;
    while ((seen = ld_acquire<Scope::kGpu>(word)) != p.seq) {
        if (spin.expired()) report_timeout(ctx.error, ctx.role, ctx.rank, ctx.channel, ctx.peer, seen, 0, p.seq);
    }
}

}  // namespace ep
