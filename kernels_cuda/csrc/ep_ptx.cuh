// Memory-model primitives (PTX) used by the transport and the rings. Scope is a template
// parameter: the EMULATED back end keeps every rank on one GPU (gpu scope suffices), the NVLINK
// back end talks to peer GPUs (system scope).
#pragma once
#include <cstdint>

namespace ep {

enum class Scope { kGpu, kSys };

template <Scope S>
__device__ __forceinline__ int ld_acquire(const int* ptr) {
    int value;
    if constexpr (S == Scope::kSys)
        asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
    else
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
    return value;
}

template <Scope S>
__device__ __forceinline__ void st_release(int* ptr, int value) {
    if constexpr (S == Scope::kSys)
        asm volatile("st.release.sys.global.b32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
    else
        asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
}

template <Scope S>
__device__ __forceinline__ int atomic_add_release(int* ptr, int value) {
    int old;
    if constexpr (S == Scope::kSys)
        asm volatile("atom.add.release.sys.global.s32 %0, [%1], %2;" : "=r"(old) : "l"(ptr), "r"(value) : "memory");
    else
        asm volatile("atom.add.release.gpu.global.s32 %0, [%1], %2;" : "=r"(old) : "l"(ptr), "r"(value) : "memory");
    return old;
}

template <Scope S>
__device__ __forceinline__ void fence_acq_rel() {
    if constexpr (S == Scope::kSys)
        asm volatile("fence.acq_rel.sys;" ::: "memory");
    else
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
}

// Plain 16-byte loads/stores for payload copies. Ring data is only read after an acquire of the
// tail that covers it, so ordinary (coherent) loads are enough; no `.nc` trick on peer data.
__device__ __forceinline__ int4 ld_int4(const int4* ptr) { return *ptr; }
__device__ __forceinline__ void st_int4(int4* ptr, int4 value) { *ptr = value; }

// Named barrier over `threads` threads of the block (ids 1..15; 0 is __syncthreads).
__device__ __forceinline__ void named_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x % 32); }
__device__ __forceinline__ int warp_id() { return static_cast<int>(threadIdx.x / 32); }

}  // namespace ep
